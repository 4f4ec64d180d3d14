"""Worker side of the allreduce strategy: DistributedDataParallel inside dist_autograd.

`trainer.model` is `DDP(module)`; inside a dist_autograd context DDP's bucketed
allreduce leaves the averaged gradients in the context, and `step(context_id)`
applies the local optimizer to them. Floating buffers (BatchNorm statistics)
are averaged over the workers at each step, the same rule the parameter
servers use, so both strategies compute the same thing.

A `gradsync.DynamicEmbedding` is no DDP parameter: every worker keeps a replica of its table, and `step`
exchanges the step's lookups and row gradients after the dense step (`worker.rows.replicated`).

NaN/Inf: a hook on each parameter checks this worker's own gradient before
DDP averages it (one cheap sum, `core.finite`), and `step` checks the
averaged gradients the same way; every worker sees the same averages, so all
of them agree whether it tripped, and only then does the step's small
collective tell every worker whose own gradient was bad, so all of them raise
or skip together. The collective also carries the used-parameter flags (with
`find_unused_parameters`) and the floating buffers; a step with none of the
three makes no collective beyond DDP's own.

Parameters that get no gradient: DDP's own `find_unused_parameters=True`
fails inside a dist_autograd context (an internal assert in torch 2.13: the
reducer looks up a gradient that the context does not hold). So with
`find_unused_parameters=True` DDP runs without it; the forward walks the
output's autograd graph (as DDP would) to find the parameters it uses and
gives the others a zero gradient, so DDP averages every parameter; `step`
then averages the used flags with the buffers and hands the optimizer
`.grad = None` for a parameter no worker used, as single-process training
does (no weight decay, no momentum). A parameter used by some workers gets
the mean over all of them, zeros from the others, as DDP gives.

Uneven data (`join`, `ddp_join`): in a join block each step counts the
active workers first; a worker that ran out of data answers the others'
collectives with zeros and applies the same averaged gradients. DDP divides
by all W, so a step with fewer workers is rescaled by W / active: the mean
over the active workers, as the parameter servers take it.

A dead worker replaced (worker_loss wait): DDP's group is this worker alone and the averaging is gradsync's own
hook over the workers' generation group (`worker.ddp.kept_averaging`, `worker.ddp.generations`), which keeps each
step's own gradients. When a collective fails, the step in flight waits in `step` for the next generation, in which
the replacement joins: the workers agree on the earliest step in flight (`_agree`), a survivor that has not applied
it sends its model and optimizer state to the replacement over the new group (`_send_state`, `_heal`), and the
survivors average their kept gradients of that step again (one that had applied it already takes part and drops
the result), while the replacement computes its part in the same layout: the step ends as it would have.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import io
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.core.buckets import ModelSpec
from gradsync.core.clipping import Clipping
from gradsync.core.errors import (
    left_early_error,
    model_mismatch_error,
    no_gradients_error,
    no_survivor_error,
    no_trainer_error,
    nonfinite_error,
    not_replaced_error,
    outside_join_error,
    step_twice_error,
)
from gradsync.core.finite import first_nonfinite
from gradsync.core.job_names import StoreKeys
from gradsync.core.torch_internals import current_context_id, gloo_group, tree_flatten, tree_unflatten
from gradsync.membership.arrivals import wait_for_every_worker
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.metrics.traffic import allreduce_bytes, sparse_bytes
from gradsync.runtime import replacement
from gradsync.runtime.failures import exit_now
from gradsync.tables.placement import TableModule
from gradsync.worker.ddp import ddp_join
from gradsync.worker.ddp.comm_timing import LastGradient, timed_hook
from gradsync.worker.ddp.ddp_hooks import make_ddp_hook
from gradsync.worker.ddp.generations import Generations
from gradsync.worker.ddp.kept_averaging import KeptAveraging
from gradsync.worker.module.amp import inverse_scale, record_found_inf
from gradsync.worker.module.model_state import named_tensors, to_state_dict
from gradsync.worker.module.user_optimizer import StepGuard
from gradsync.worker.rows.choice import WORTH_SERVING_SHARE
from gradsync.worker.rows.replicated import ReplicatedRows
from gradsync.worker.strategies.strategy import Strategy

if TYPE_CHECKING:  # imports point one way: the start-up code (cluster) builds the strategies
    from gradsync.runtime.cluster import Cluster


_FIRST_BUCKET_BYTES = 1 << 20
"""The averaging's first bucket under worker_loss wait, small so that its allreduce starts early (as DDP's)."""

_BUCKET_BYTES = 25 << 20
"""The averaging's other buckets without bucket_cap_mb (DDP's default)."""


def _check_same_model(spec: ModelSpec, num_workers: int, group: dist.ProcessGroup | None) -> None:
    """Every worker must reach this: compares each worker's model with worker 0's (over `group`; None: the
    default group)."""
    specs: list = [None] * num_workers
    dist.all_gather_object(specs, spec, group=group)
    for other, theirs in enumerate(specs):
        diff = specs[0].difference(theirs)
        if diff is not None:
            raise model_mismatch_error(other, diff)


def _sparse_weights(module: nn.Module) -> set[int]:
    """The ids of the tables whose gradients are sparse (`nn.Embedding(..., sparse=True)`): DDP all-gathers
    their rows."""
    return {id(m.weight) for m in _tables(module) if m.sparse}


def _tables(module: nn.Module) -> list[TableModule]:
    """The embedding tables DDP averages (not those hybrid serves, whose weight it took away)."""
    return [
        m
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.weight is not None and m.weight.requires_grad
    ]


def _no_buffer_broadcast() -> dict:
    """DDP keyword that stops it broadcasting rank 0's buffers each forward (we average them instead)."""
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _allreduce_mean(tensors: Sequence[torch.Tensor], workers: int, group: dist.ProcessGroup | None = None) -> None:
    """Average `tensors` in place over the workers of `group` (None: the default group): one flattened allreduce
    per dtype, none for no tensors. Every worker must reach it."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for alike in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in alike])
        dist.all_reduce(flat, group=group)
        flat.div_(workers)
        for t, mean in zip(alike, flat.split([t.numel() for t in alike])):
            t.copy_(mean.view_as(t))


def _reached(outputs: list[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors that the outputs' backward reaches (the walk DDP's find_unused_parameters does)."""
    ids = {id(t) for t in outputs if t.grad_fn is None}
    stack, seen = [t.grad_fn for t in outputs if t.grad_fn is not None], set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: the gradient's way into a leaf
            ids.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return ids


class _ZeroGrads(torch.autograd.Function):
    """A zero scalar whose backward gives each of its inputs a zero gradient."""

    @staticmethod
    def forward(ctx, *params):
        ctx.like = [(p.shape, p.dtype, p.device) for p in params]
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)


class _Model(nn.Module):
    """`trainer.model`: the DDP module, called through the strategy's forward."""

    def __init__(self, ddp: DDP, forward):
        super().__init__()
        self.ddp = ddp
        self._forward = forward

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The user's module, as DDP's `.module`."""
        return self.ddp.module


def wait_for_trainers(cluster: Cluster) -> None:
    """Wait until every worker has begun to build its Trainer (the start-up timeout), before a collective that
    would wait for them bounded only by the step timeout; a worker that never builds one is named."""
    config = cluster.config
    wait_for_every_worker(
        cluster.store,
        StoreKeys.TRAINERS,
        config.num_workers,
        config.startup_timeout,
        lambda missing, built: no_trainer_error(missing, built, config.startup_timeout),
    )


class AllreduceStrategy(Strategy):
    """DDP + local optimizer. Every worker must construct it (a collective)."""

    def __init__(
        self,
        cluster: Cluster,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        find_unused_parameters: bool = False,
        clipping: Clipping = Clipping(),
        table_optimizer=None,
        replicate_dynamic: bool = True,
        metrics: StepMetrics | None = None,
    ):
        """`replicate_dynamic`: keep a replica of every DynamicEmbedding (allreduce); False under hybrid and
        sharded, whose dense part this is and which hold those rows elsewhere (`metrics`: theirs, which their
        tables count in too)."""
        config = cluster.config
        self.cluster = cluster
        self.config = config
        self.worker = config.worker_rank
        self.metrics = metrics or StepMetrics()
        self.rows = ReplicatedRows(
            module if replicate_dynamic else None,
            table_optimizer,
            config.worker_rank,
            config.num_workers,
            config.nonfinite,
            lambda: self.active,
            self.metrics,
        )
        self.started = 0  # steps begun: contexts with a training forward (with grad)
        self._begun: int | None = None  # the context of the last step begun
        params, buffers = named_tensors(module)
        wait_for_trainers(cluster)  # DDP's construction is a collective, bounded only by the step timeout
        # worker_loss wait: the workers' group by generation, formed anew after each death
        self.generations = Generations(cluster.store, config) if config.replaces_workers else None
        if not config.replacement:
            _check_same_model(ModelSpec.of(params, buffers), config.num_workers, self._group())
        self.module = module
        self.trainable = [p for p in params.values() if p.requires_grad]  # what DDP averages
        self.names = {p: n for n, p in params.items()}
        self.buffers = [b for b in buffers.values() if b.is_floating_point()]
        self.counters = [b for b in buffers.values() if not b.is_floating_point()]  # num_batches_tracked
        self.joining = False  # inside a join block: each step counts the active workers
        self.join_rounds = 0  # join blocks this worker has opened
        self.active = config.num_workers  # workers in this step
        self._shadowing = False  # joined: answering the others' steps
        self.find_unused = find_unused_parameters
        self._used: set[int] = set()  # ids of the parameters this step's forward passes used
        self._last_context: int | None = None
        self.averaging: KeptAveraging | None = None
        self._kept_sync: dict[int, list[torch.Tensor]] = {}  # worker_loss wait: each step's own sync inputs
        self._buffers_began: dict[str, torch.Tensor] = {}  # worker_loss wait: the buffers as the step in flight began
        if self.generations is not None:
            self._replaced_ddp(module)
        else:
            self.ddp = DDP(module, **_no_buffer_broadcast())
        # else DDP's built-in allreduce: it divides by W as it copies, no extra pass (the timeline needs a hook)
        if self.averaging is None and (config.compression != "none" or self.metrics.timeline.on):
            hook_state, hook = make_ddp_hook(config.compression)
            self.ddp.register_comm_hook(hook_state, timed_hook(hook, self.metrics.timeline, config.compression))
        self.local_nonfinite = False
        for p in self.trainable:
            p.register_hook(self._check_local)
        self.last_gradient = LastGradient(self.trainable)
        self.model = _Model(self.ddp, self._forward)
        self.optimizer = optimizer  # the user's own, over the module's parameters, which DDP keeps
        self.steps = StepGuard(optimizer)
        self.clipping = clipping
        self.grad_norm: float | None = None
        sparse = _sparse_weights(module)
        dense = sum(p.numel() for p in self.trainable if id(p) not in sparse)
        self.dense_bytes = int(allreduce_bytes(dense, config.num_workers, config.compression)[0])
        self.rows_bytes = 0  # this step's rows of the sparse tables: this worker's part of their all-gather
        self.sparse = [p for p in self.trainable if id(p) in sparse]
        elements = sum(p.numel() for p in module.parameters())  # dense tables worth compare's note on sparse=True
        self.dense_tables = sum(
            not m.sparse and m.weight.numel() >= WORTH_SERVING_SHARE * elements for m in _tables(module)
        )
        for p in self.sparse:
            p.register_hook(self._count_rows)
        cluster.heartbeat.on_left(self._peer_left)
        if self.generations is not None:
            self._check_replaceable()
            self._heal() if config.replacement else self._broadcast_first()

    def _group(self) -> dist.ProcessGroup | None:
        """The group the workers' collectives go over: the generation's (worker_loss wait), else the default."""
        return self.generations.group if self.generations is not None else None

    def _replaced_ddp(self, module: nn.Module) -> None:
        """DDP over this worker alone, averaged by the kept averaging's hook over the generation group."""
        config = self.config
        alone = dist.PrefixStore(
            f"{StoreKeys.PROCESS_GROUP}/alone/{self.worker}/{config.replacement}", self.cluster.store
        )
        timeout = datetime.timedelta(seconds=config.step_timeout)
        self.ddp = DDP(module, process_group=gloo_group(alone, 0, 1, timeout), **_no_buffer_broadcast())
        cap = int(config.bucket_cap_mb * 2**20) if config.bucket_cap_mb else _BUCKET_BYTES
        caps = (min(cap, _FIRST_BUCKET_BYTES), cap)
        sparse = _sparse_weights(module)
        # each step's RNG states for a replacement, before any of its gradients leave (trainer.step records them
        # too, later: the others may finish the step before this worker reaches it)
        record = lambda: replacement.record(self.cluster.store, self.worker, self.cluster.steps)  # noqa: E731
        self.averaging = KeptAveraging(
            self.trainable, caps, sparse, config.num_workers, self._group, lambda: self.started, record
        )
        self.ddp.register_comm_hook(None, self.averaging.hook)

    def _check_replaceable(self) -> None:
        """Refuse what a replacement cannot rejoin yet (worker_loss wait)."""
        if self.rows.holds_dynamic:
            raise not_replaced_error("a gradsync.DynamicEmbedding")
        if self.config.compression != "none":
            raise not_replaced_error(f"compression={self.config.compression!r}")

    def _broadcast_first(self) -> None:
        """Make every worker's parameters and buffers worker 0's, as DDP's construction does over its group."""
        group = self._group()
        assert group is not None
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                group.broadcast(t.data, 0).wait()

    def _agree(self, in_flight: int | None, deadline: float) -> tuple[int, int, list[int]]:
        """Form the next generation and take its first collective (again in a later one while a death ends it),
        by `deadline`: each worker's step in flight (`self.started`; None: a replacement, which holds none).
        Returns (the earliest of them, the lowest worker in that step, the replacements).

        Raises:
            RuntimeError: every worker is a replacement (`no_survivor_error`).
        """
        assert self.generations is not None
        workers = self.config.num_workers
        told = torch.zeros(2 * workers, dtype=torch.int64)
        told[self.worker] = int(in_flight is None)
        told[workers + self.worker] = in_flight or 0
        while True:
            self.generations.form(deadline)
            agreed = told.clone()
            try:
                self.generations.group.allreduce([agreed]).wait()  # type: ignore[union-attr]  # formed
                break
            except RuntimeError:  # a death in the generation: the next one
                continue
        new = [w for w in range(workers) if agreed[w]]
        steps = {w: int(agreed[workers + w]) for w in range(workers) if w not in new}
        if not steps:
            raise no_survivor_error(workers)
        earliest = min(steps.values())
        return earliest, min(w for w, s in steps.items() if s == earliest), new

    def _healing_key(self) -> str:
        assert self.generations is not None
        return StoreKeys.HEALING.format(self.generations.number)

    def _send_state(self, in_step: bool, new: list[int]) -> None:
        """Send this worker's model and optimizer state as its step in flight began (`in_step`: the forward has
        since updated its buffers, BatchNorm's statistics; else as the next step begins) to the replacements
        `new`: its size through the store, its bytes over the group."""
        model = self.module.state_dict()
        if in_step:
            model.update({n: b for n, b in self._buffers_began.items() if n in model})
        buffer = io.BytesIO()
        torch.save({"model": model, "optimizer": self.optimizer.state_dict()}, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        self.cluster.store.set(self._healing_key(), str(data.numel()))
        group = self._group()
        assert group is not None
        for worker in new:
            group.send([data], worker, 0).wait()

    def _take_state(self, source: int, deadline: float) -> dict:
        """The state `source` sends (`_send_state`), within `deadline` (time.monotonic())."""
        key = self._healing_key()
        self.cluster.store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        data = torch.empty(int(self.cluster.store.get(key)), dtype=torch.uint8)
        group = self._group()
        assert group is not None
        group.recv([data], source, 0).wait()
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    def _heal(self) -> None:
        """A replacement: form the next generation with the others, and take the state a survivor left of the
        earliest step in flight, which this process begins (`rejoined_at`), within restart_timeout."""
        assert self.generations is not None
        config = self.config
        deadline = time.monotonic() + config.restart_timeout
        while True:
            in_flight, source, _ = self._agree(None, deadline)
            try:
                state = self._take_state(source, deadline)
                break
            except RuntimeError:  # a death in the generation: the next one
                continue
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.started = in_flight - 1
        assert self.averaging is not None
        self.averaging.deferred = True
        first = self.cluster.resumed.step if self.cluster.resumed is not None else 0
        self.rejoined_at = self.started - first

    def between_steps(self) -> None:
        """A replacement coming while this worker waits between steps (for a checkpoint's parts, one of them the
        dead worker's): form the next generation with it and heal it, as of the step after this worker's."""
        if self.generations is None or not self.generations.numbered():
            return
        deadline = time.monotonic() + self.config.restart_timeout
        while True:
            _, source, new = self._agree(self.started + 1, deadline)
            try:
                if source == self.worker and new:
                    self._send_state(False, new)
                return
            except RuntimeError:  # another death: the next generation
                continue

    def _averaged_kept(self, averaged: list, scaler) -> list:
        """The step's averages under worker_loss wait: DDP's (`averaged`), or, in a replacement's first step or
        after a failed collective, the kept gradients averaged now."""
        assert self.averaging is not None
        if self.averaging.deferred:  # a replacement's first step: its loss was scaled by its own GradScaler's scale
            self.averaging.deferred = False
            if scaler is not None:
                self.averaging.rescale(self.started, scaler.state_dict()["scale"] / scaler.get_scale())
            try:
                return self.averaging.replay(self.started)
            except RuntimeError:  # another death
                self.averaging.broken = True
        return self._recover() if self.averaging.broken else averaged

    def _recover(self) -> list[torch.Tensor]:
        """After a failed collective of the step in flight: form the next generation (within restart_timeout),
        heal its replacements, average the kept gradients of the earliest step in flight again (dropping the
        result where this worker had applied it) and then of this one, whose averages it returns."""
        assert self.generations is not None and self.averaging is not None
        deadline = time.monotonic() + self.config.restart_timeout
        in_flight = self.started
        while True:
            earliest, source, new = self._agree(in_flight, deadline)
            try:
                if source == self.worker and new:
                    self._send_state(True, new)
                if in_flight == earliest + 1:
                    self.averaging.replay(earliest)
                    if earliest in self._kept_sync:
                        _allreduce_mean([t.clone() for t in self._kept_sync[earliest]], self.active, self._group())
                averaged = self.averaging.replay(in_flight)
            except RuntimeError:  # another death: the next generation
                continue
            self.averaging.broken = False
            return averaged

    def _forward(self, *args, **kwargs):
        self.metrics.pulled(0.0, 0)  # marks the start of the step
        context = current_context_id() if torch.is_grad_enabled() else None
        before = self.started, self._begun
        if context is not None:
            if context != self._begun:  # the step's first forward (micro-batches share its context)
                self.started, self._begun = self.started + 1, context
                if self.generations is not None:  # a replacement heals from the buffers as the step began
                    self._buffers_began = {n: b.clone() for n, b in self.module.named_buffers()}
            if self.joining:
                self.active = ddp_join.count_active(True, self.trainable[0].device)
        try:
            out = self.ddp(*args, **kwargs)
        except Exception:  # refused before the step began (bad ids): no peer waits on it (`_peer_left`)
            self.started, self._begun = before
            raise
        if self.find_unused and torch.is_grad_enabled():
            out = self._tie_unused(out)
        return out

    def _peer_left(self, worker: int, steps: int | None) -> None:
        """Heartbeat thread: worker `worker` left after `steps` steps. When this worker has begun a later step, or
        has joined and answers the others' steps, those collectives can never complete, and its main thread
        waits in them out of reach: exit now."""
        assert steps is not None  # only an elastic job's worker goes without saying its steps (none under DDP)
        if self._shadowing or self.started > steps:
            waiting = f"worker {self.worker} (in its step {self.started})"
            exit_now(self.cluster, str(left_early_error(worker, steps, waiting)))

    def _tie_unused(self, out):
        """Record the parameters `out` uses; add the others to `out` as a zero with zero gradients."""
        leaves, spec = tree_flatten(out)
        tracked = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tracked:
            return out
        reached = _reached([leaves[i] for i in tracked])
        self._used |= reached
        unused = [p for p in self.trainable if id(p) not in reached]
        if not unused:
            return out
        leaves[tracked[0]] = leaves[tracked[0]] + _ZeroGrads.apply(*unused)
        return tree_unflatten(leaves, spec)

    def model_sizes(self, trainable: int) -> dict[str, int]:
        """What `gradsync compare` models and reports: dense elements, the tables with sparse gradients (their
        elements and how many), whose touched rows are all-gathered, and how many tables large enough to matter
        (`WORTH_SERVING_SHARE`) are averaged densely."""
        tables = sum(p.numel() for p in self.sparse)
        return {
            "dense": trainable - tables,
            "tables": tables,
            "sparse_tables": len(self.sparse),
            "dense_tables": self.dense_tables,
        }

    def _count_rows(self, grad: torch.Tensor) -> None:
        """Sparse table hook: the bytes of this worker's own rows (distinct rows and their indices, as gloo
        sends them), which a ring all-gather forwards to every other worker: W-1 times through each link."""
        if grad.is_sparse:
            self.rows_bytes += (self.config.num_workers - 1) * sparse_bytes(grad.coalesce())

    def _check_local(self, grad: torch.Tensor) -> None:
        """Parameter hook: note a NaN/Inf in this worker's own gradient, before DDP averages it."""
        if first_nonfinite([grad]) is not None:
            self.local_nonfinite = True

    def step(self, context_id: int, scaler=None) -> bool:
        """Apply the optimizer to the averaged gradients of `context_id` (unscaled by `scaler`, a GradScaler,
        and clipped, as a single-process loop does), then the dynamic tables' rows to every replica
        (`rows.replicated`). Every worker must call it, once per context, after `dist_autograd.backward` in
        that context. Returns False when the step was dropped for a NaN/Inf (nonfinite='skip', or an inf/NaN
        under the scaler), the same on every worker."""
        rows = self.rows.gradients(context_id, dist_autograd.get_gradients(context_id), scaler)
        coefficient, start = self._dense(context_id, scaler, None)
        self.rows.end_step(self.rows.apply(rows, coefficient))
        self._committed(start)
        return coefficient is not None

    def dense_step(self, context_id: int, scaler=None, outside: list[float] | None = None) -> float | None:
        """`step` as the dense part of a strategy whose tables are held elsewhere (hybrid, sharded): `outside`,
        the tables' partial norms of the step's averaged rows, which the total norm adds to this part's under
        clipping or a GradScaler (None: the tables' rows are not clipped with the dense layers). Returns the
        coefficient the dense gradients were multiplied by, which the tables' rows take too (1.0 without
        `outside`), or None when the step was dropped, the same on every worker."""
        coefficient, start = self._dense(context_id, scaler, outside)
        self._committed(start)
        return coefficient

    def _dense(self, context_id: int, scaler, outside: list[float] | None) -> tuple[float | None, float]:
        """The dense layers' step (`dense_step`'s answer), and when it began."""
        if context_id == self._last_context:
            raise step_twice_error(context_id)
        start = time.perf_counter()
        grads = dist_autograd.get_gradients(context_id)
        if not grads:
            raise no_gradients_error(context_id)
        self._last_context = context_id
        averaged = [grads.get(p) for p in self.trainable]
        if self.averaging is not None:
            averaged = self._averaged_kept(averaged, scaler)
        return self._apply(averaged, joined=False, scaler=scaler, outside=outside), start

    def _committed(self, start: float) -> None:
        """The step's record: the wait for DDP's last buckets after the last gradient is communication (commit,
        not compute)."""
        wire, self.rows_bytes = self.dense_bytes + self.rows_bytes, 0
        self.metrics.committed(start - self.last_gradient.wait_before(start), wire, wire)

    def _apply(
        self, averaged: list[torch.Tensor | None], joined: bool, scaler=None, outside: list[float] | None = None
    ) -> float | None:
        """The rest of a step, the same on every worker, active or `joined`: the step's small collective,
        then the optimizer on the averaged gradients, rescaled to the mean over the active workers, unscaled
        by `scaler` and clipped (`dense_step`'s `outside` and answer)."""
        if self.active != self.config.num_workers:
            scale = self.config.num_workers / self.active
            averaged = [None if g is None else g * scale for g in averaged]
        suspect = first_nonfinite([g for g in averaged if g is not None]) is not None  # the same on every worker
        bad_workers: list[int] = []
        used = [True] * len(self.trainable)
        if suspect or self.find_unused or self.buffers:
            bad_workers, used = self._sync(joined)
        self.local_nonfinite = False
        # the gradients stay in .grad until the next step, as in a plain PyTorch loop: freeing them at once
        # measured slower (BENCHMARKS.md, "Wrapper overhead against plain PyTorch"; the floor there keeps them too)
        for p, u, g in zip(self.trainable, used, averaged):
            p.grad = g if u else None
        live = [p for p in self.trainable if p.grad is not None]
        with self.steps.open():  # the user's optimizer steps here only (`user_optimizer`)
            if scaler is not None and outside is None:  # an inf/NaN is the scaler's: it skips and backs off
                scaler.unscale_(self.optimizer)
                stepped = first_nonfinite([p.grad for p in live if p.grad is not None]) is None
                self._clip(live)
                scaler.step(self.optimizer)
                scaler.update()
                return 1.0 if stepped else None
            bad = first_nonfinite([p.grad for p in live if p.grad is not None]) if suspect and scaler is None else None
            if bad is None:
                if outside is not None and (scaler is not None or self.clipping.on):
                    return self._agreed(live, scaler, outside)
                self._clip(live)
                self.optimizer.step()
            if bad is not None and self.config.nonfinite == "raise":
                raise nonfinite_error(self.names[live[bad]], bad_workers[0] if bad_workers else "unknown")
            return 1.0 if bad is None else None

    def _agreed(self, live: list[torch.Tensor], scaler, outside: list[float]) -> float | None:
        """The step of a dense part with clipping or a GradScaler: the total norm adds the tables' partial norms
        of the averaged rows (`outside`) to this dense part's, and the dense gradients are clipped by the joint
        coefficient, which it returns for the rows (None: skipped on an inf/NaN)."""
        grads = [p.grad for p in live if p.grad is not None]  # every one of `live`
        unscale = inverse_scale(scaler)
        if unscale != 1.0:
            for g in grads:
                g.mul_(unscale)
        total = self.clipping.total([self.clipping.partial(grads), *outside])
        finite = math.isfinite(total)
        coefficient = 1.0
        if self.clipping.on:
            self.grad_norm = total
            coefficient = self.clipping.coefficient(total)
        if finite:
            if coefficient < 1.0:
                for g in grads:
                    g.mul_(coefficient)
            self.optimizer.step()
        if scaler is not None:
            record_found_inf(scaler, not finite)
        return coefficient if finite else None

    def no_sync(self):
        """`Trainer.no_sync`: DDP's own."""
        return self.ddp.no_sync()

    def _clip(self, live: list[torch.Tensor]) -> None:
        if (max_norm := self.clipping.max_norm) is not None:  # `clipping.on`
            self.grad_norm = float(
                torch.nn.utils.clip_grad_norm_(
                    live, max_norm, self.clipping.norm_type, self.clipping.error_if_nonfinite
                )
            )

    def _sync(self, joined: bool) -> tuple[list[int], list[bool]]:
        """The step's one collective (every worker must reach it): which workers saw a NaN/Inf in their
        own gradient, which parameters any worker used (with find_unused_parameters; else all), and
        the mean of the floating buffers over the active workers (a `joined` worker sends zeros)."""
        workers = self.config.num_workers
        used, self._used = self._used, set()
        marks = [id(p) in used for p in self.trainable] if self.find_unused else []
        flags = torch.tensor([0.0] * workers + marks, dtype=torch.float32)
        flags[self.worker] = float(self.local_nonfinite)
        with torch.no_grad():
            if joined:
                for b in self.buffers:
                    b.zero_()
            self._average_sync([flags, *self.buffers])
        seen = flags.gt(0).tolist()
        return [w for w in range(workers) if seen[w]], seen[workers:] or [True] * len(self.trainable)

    def _average_sync(self, tensors: list[torch.Tensor]) -> None:
        """The step's small collective on `tensors`; under worker_loss wait, kept for a replay and, should a
        worker die, done again once its replacement has joined."""
        if self.averaging is None:
            _allreduce_mean(tensors, self.active)
            return
        kept = [t.clone() for t in tensors]
        self._kept_sync = {n: k for n, k in self._kept_sync.items() if n == self.started - 1}
        self._kept_sync[self.started] = kept
        while True:
            try:
                _allreduce_mean(tensors, self.active, self._group())
                return
            except RuntimeError:  # a worker died: again with its replacement, from the kept inputs
                for t, k in zip(tensors, kept):
                    t.copy_(k)
                self._recover()

    @contextlib.contextmanager
    def join(self, joined: Callable[[], None] = lambda: None):
        """`Trainer.join`: count the active workers at each step; on leaving the block, call `joined`, then
        answer the others' steps until every worker has joined. Waits first until every worker has opened
        its block (half the step timeout at most)."""
        if self.generations is not None:
            raise not_replaced_error("trainer.join()")
        key, seconds = StoreKeys.JOIN_ENTERED.format(self.join_rounds), self.config.step_timeout / 2
        # Store.append: missing from torch's stubs
        self.cluster.store.append(key, f"{self.worker},")  # type: ignore[attr-defined]
        # a worker that trains outside the block would meet `count_active` with a gradient bucket, a collective
        # mismatch that gloo aborts the process on (SIGABRT) instead of raising
        wait_for_every_worker(
            self.cluster.store,
            key,
            self.config.num_workers,
            seconds,
            lambda outside, inside: outside_join_error(outside, inside, seconds),
        )
        self.join_rounds += 1
        self.joining = True
        try:
            yield
            joined()
            self._shadow_until_all_joined()
        finally:
            self.joining, self.active = False, self.config.num_workers

    def _shadow_until_all_joined(self) -> None:
        """Answer every step the other workers still take (`ddp_join`), applying the same update; then take
        the integer buffers of a worker that was active to the end. Every worker must reach it."""
        device, last = self.trainable[0].device, True
        self._shadowing = True
        try:
            while (active := ddp_join.count_active(False, device)) > 0:
                last, self.active = False, active
                self.started += 1  # a step this worker takes part in: it counts, as the others' do
                self.cluster.steps += 1
                grads = ddp_join.shadow_buckets(self.ddp)
                coefficient = self._apply([grads.get(p) for p in self.trainable], joined=True)
                self.rows.end_step(self.rows.apply(self.rows.gradients(None, {}), coefficient))
        finally:
            self._shadowing = False
        if self.counters:
            ddp_join.broadcast_from_last(self.counters, last, device)

    @property
    def writes_deltas(self) -> bool:
        return self.rows.holds_dynamic

    def local_state(self, delta: bool = False) -> dict:
        """What a checkpoint keeps of this worker: the model's and the optimizer's state; the dynamic tables'
        replicas under "tables", with their row optimizer state (`ReplicatedRows.checkpoint`; `delta`: what
        changed since the last full checkpoint), not in "model"."""
        replicated = self.rows.keys()
        model = {k: v for k, v in self.module.state_dict().items() if k not in replicated}
        return {"model": model, "optimizer": self.optimizer.state_dict(), **self.rows.checkpoint(delta)}

    def load_local_state(self, state: dict) -> None:
        """Take back `local_state()` of a checkpoint taken after step `state["step"]` (the replicas come with
        `load_rows`); a replacement keeps the later state a live worker gave it (`_heal`)."""
        if self.rejoined_at is not None:
            return
        self.module.load_state_dict({**self.rows.state(), **state["model"]})  # the replicas' keys as they are
        self.optimizer.load_state_dict(state["optimizer"])
        self.started = state["step"]

    def load_rows(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None = None) -> None:
        """The replicas of the worker file this worker restores from (the first of `saved`); a delta's onto that
        worker's replicas in the full checkpoint (`full()`)."""
        self.rows.restore(saved, where, full)

    def state_dict(self) -> dict[str, torch.Tensor]:
        params, buffers = named_tensors(self.module)
        values = {n: t.detach().clone() for n, t in {**params, **buffers}.items()}
        return to_state_dict(self.module, {**values, **self.rows.state()})
