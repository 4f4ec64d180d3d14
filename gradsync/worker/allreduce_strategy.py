"""Worker side of the allreduce strategy: DistributedDataParallel inside dist_autograd.

`trainer.model` is `DDP(module)`; inside a dist_autograd context DDP's bucketed
allreduce leaves the averaged gradients in the context, and `step(context_id)`
applies the local optimizer to them. Floating buffers (BatchNorm statistics)
are averaged over the workers after each step, the same rule the parameter
servers use, so both strategies compute the same thing.
"""
from __future__ import annotations

import inspect
import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.cluster import Cluster
from gradsync.cuda_ops import DEFAULT_BLOCK_SIZE
from gradsync.ps.buckets import ModelSpec
from gradsync.worker.ddp_hooks import make_ddp_hook
from gradsync.worker.metrics import StepMetrics
from gradsync.worker.model_state import named_tensors, to_state_dict


def _check_same_model(spec: ModelSpec, worker: int, num_workers: int) -> None:
    """Every worker must reach this: compares each worker's model with worker 0's."""
    specs: list = [None] * num_workers
    dist.all_gather_object(specs, spec)
    for other, theirs in enumerate(specs):
        diff = specs[0].difference(theirs)
        if diff is not None:
            raise ValueError(
                f"worker {other}'s model differs from worker 0's: {diff}. Every worker must build the "
                "same model (same classes, same constructor arguments)"
            )


def _wire_bytes(params, workers: int, compression: str) -> int:
    """Bytes each worker sends (and receives) per step: a ring allreduce moves 2 (W-1)/W of the
    payload; int8 all-gathers 1 byte per value plus one fp32 scale per block to W-1 peers."""
    numel = sum(p.numel() for p in params)
    if compression == "int8":
        return (workers - 1) * (numel + 4 * -(-numel // DEFAULT_BLOCK_SIZE))
    itemsize = 2 if compression in ("fp16", "bf16") else 4
    return int(2 * (workers - 1) / workers * numel * itemsize)


def _no_buffer_broadcast() -> dict:
    """DDP keyword that stops it broadcasting rank 0's buffers each forward (we average them instead)."""
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class _Timer(nn.Module):
    """Marks the start of each forward pass for the step metrics."""

    def __init__(self, ddp: DDP, metrics: StepMetrics):
        super().__init__()
        self.ddp = ddp
        self._metrics = metrics

    def forward(self, *args, **kwargs):
        self._metrics.pulled(0.0, 0)
        return self.ddp(*args, **kwargs)


class AllreduceStrategy:
    """DDP + local optimizer. Every worker must construct it (a collective)."""

    def __init__(self, cluster: Cluster, module: nn.Module, optimizer_cls, optimizer_kwargs: dict):
        config = cluster.config
        self.config = config
        self.worker = config.worker_rank
        self.metrics = StepMetrics()
        params, buffers = named_tensors(module)
        _check_same_model(ModelSpec.of(params, buffers), self.worker, config.num_workers)
        self.module = module
        self.names = {p: n for n, p in params.items()}
        self.buffers = [b for b in buffers.values() if b.is_floating_point()]
        self.ddp = DDP(module, **_no_buffer_broadcast())
        state, hook = None, default_hooks.allreduce_hook
        if config.compression != "none":
            state, hook = make_ddp_hook(config.compression)
        self.local_nonfinite = False
        self.ddp.register_comm_hook(state, self._checked(hook))
        self.model = _Timer(self.ddp, self.metrics)
        self.optimizer = optimizer_cls(list(params.values()), **optimizer_kwargs)
        self.wire_bytes = _wire_bytes(params.values(), config.num_workers, config.compression)

    def _checked(self, hook):
        """Wrap a DDP comm hook so a NaN/Inf in this worker's own gradient is noticed before averaging."""

        def checked_hook(state, bucket):
            if not bool(torch.isfinite(bucket.buffer()).all()):
                self.local_nonfinite = True
            return hook(state, bucket)

        return checked_hook

    def step(self, context_id: int) -> None:
        """Apply the optimizer to the averaged gradients of `context_id`. Every worker must call it."""
        start = time.perf_counter()
        grads = dist_autograd.get_gradients(context_id)
        params = list(self.names)
        for p in params:
            p.grad = grads.get(p)
        bad = [self.names[p] for p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if bad:
            self._nonfinite(bad[0])
        else:
            self.optimizer.step()
        self.local_nonfinite = False
        for p in params:
            p.grad = None
        with torch.no_grad():
            for b in self.buffers:
                dist.all_reduce(b)
                b.div_(self.config.num_workers)
        self.metrics.committed(start, self.wire_bytes, self.wire_bytes)

    def _nonfinite(self, name: str) -> None:
        """All workers see the same averaged NaN; find which worker's local gradient produced it."""
        flags = torch.zeros(self.config.num_workers)
        flags[self.worker] = float(self.local_nonfinite)
        dist.all_reduce(flags)
        self.local_nonfinite = False
        if self.config.nonfinite == "skip":
            return
        workers = [i for i, f in enumerate(flags.tolist()) if f] or ["unknown"]
        raise ValueError(
            f"non-finite gradient (NaN or Inf) for parameter {name!r} from worker {workers[0]}: "
            "lower the learning rate or check the loss; pass nonfinite='skip' to gradsync.init "
            "(or GRADSYNC_NONFINITE=skip) to drop such steps instead"
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        params, buffers = named_tensors(self.module)
        values = {n: t.detach().clone() for n, t in {**params, **buffers}.items()}
        return to_state_dict(self.module, values)
