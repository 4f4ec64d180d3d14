"""Worker side of the parameter-server strategy: pull, functional forward, commit.

`PSStrategy.model` wraps the user's module. Its forward pulls every server's
buckets (one asynchronous call per server, through the job's transport), then
runs the module on views of them with `torch.func.functional_call`. Over torch
RPC without compression the pulled tensors are recorded by distributed
autograd, so `dist_autograd.backward` sends each bucket's gradient back to its
server and `step(context_id)` only asks every server to apply it. Otherwise
(compression, or the gRPC transport) the pulled buckets are local leaves:
`step` reads their gradients from the context, encodes them (`ps.wire`) and
pushes them. Either way `step` returns once every server has applied the step.
"""
from __future__ import annotations

import time

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.func import functional_call

from gradsync.cluster import Cluster
from gradsync.ps import server as ps_server
from gradsync.ps.buckets import ModelSpec, assign_buffers, by_server, plan_buckets
from gradsync.ps.wire import make_wire
from gradsync.worker.grpc_transport import GrpcTransport
from gradsync.worker.rpc_transport import RpcTransport
from gradsync.worker.metrics import StepMetrics
from gradsync.worker.model_state import named_tensors, to_state_dict


def current_context_id() -> int | None:
    """The id of the active dist_autograd context, or None outside one."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:
        return None


class _Pulled:
    """Tensors of one pull: parameter views and buffers by name, each server's version and bucket tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], versions: dict[int, int], buffer_names: dict[int, list],
                 flats: dict[int, list[torch.Tensor]]):
        self.tensors = tensors
        self.versions = versions
        self.buffer_names = buffer_names
        self.flats = flats


class PSModel(nn.Module):
    """The user's module, run on parameters pulled from the servers."""

    def __init__(self, module: nn.Module, strategy: "PSStrategy"):
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # a list keeps nn.Module from registering it

    def forward(self, *args, **kwargs):
        strategy = self._strategy[0]
        pulled = strategy.pull(current_context_id())
        return functional_call(self.module, pulled.tensors, args, kwargs)


class PSStrategy:
    """Pull / commit against the parameter servers. Every worker must construct it (a barrier)."""

    def __init__(self, cluster: Cluster, module: nn.Module, optimizer_cls, optimizer_kwargs: dict):
        self.config = cluster.config
        self.worker = self.config.worker_rank
        self.metrics = StepMetrics()
        params, buffers = named_tensors(module)
        self.spec = ModelSpec.of(params, buffers)
        cap = int(self.config.bucket_cap_mb * 2**20)
        self.buckets = plan_buckets(self.spec.params, self.config.servers, cap)
        self.buffer_server = assign_buffers(self.spec.buffers, self.config.servers)
        self.servers = list(range(self.config.servers))
        self.server_buckets = by_server(self.buckets, self.config.servers)
        self.wire = make_wire(self.config.compression)
        if self.config.transport == "grpc":
            self.transport = GrpcTransport(self.config, cluster.store, self.server_buckets, self.buffer_server)
        else:
            self.transport = RpcTransport(self.config, self.servers)
        # over torch RPC without compression, gradients ride the distributed backward to the servers;
        # otherwise the pulled buckets are local leaves and step() encodes and pushes their gradients
        self.explicit_push = not self.transport.records_gradients
        self._register(params, buffers, optimizer_cls, optimizer_kwargs)
        for p in params.values():  # the servers own the values now; the local copies are never used
            p.requires_grad_(False)
        self.model = PSModel(module, self)
        self._last: tuple[int | None, _Pulled] | None = None

    def _register(self, params, buffers, optimizer_cls, optimizer_kwargs) -> None:
        setups = {}
        for s in self.servers:
            setups[s] = None
            if self.worker == 0:
                my_buffers = {n: t for n, t in buffers.items() if self.buffer_server[n] == s}
                setups[s] = ps_server.make_setup(self.server_buckets[s], params, my_buffers, optimizer_cls,
                                                 optimizer_kwargs)
        self.transport.register(self.spec, setups)

    def pull(self, context_id: int | None) -> _Pulled:
        """Fetch every server's buckets (once per context; a second forward reuses them)."""
        if context_id is not None and self._last is not None and self._last[0] == context_id:
            return self._last[1]
        start = time.perf_counter()
        results = self.transport.pull(context_id)
        tensors, versions, buffer_names, all_flats, received = {}, {}, {}, {}, 0
        for s, (version, flats, buffers) in results.items():
            versions[s] = version
            if self.explicit_push and context_id is not None:
                flats = [f.requires_grad_(True) for f in flats]  # local leaves: backward leaves their grads here
            all_flats[s] = flats
            for bucket, flat in zip(self.server_buckets[s], flats):
                tensors.update(bucket.views(flat))
                received += flat.nbytes
            tensors.update(buffers)
            buffer_names[s] = list(buffers)
            received += sum(b.nbytes for b in buffers.values())
        pulled = _Pulled(tensors, versions, buffer_names, all_flats)
        if context_id is not None:
            self._last = (context_id, pulled)
            self.metrics.pulled(time.perf_counter() - start, received)
        return pulled

    def step(self, context_id: int) -> None:
        """Commit this context's gradients on every server and wait until they are applied."""
        if self._last is None or self._last[0] != context_id:
            raise RuntimeError(
                f"step({context_id}) found no forward pass in that context: call trainer.model(...) inside "
                "the same dist_autograd.context() before trainer.step(context_id)"
            )
        pulled = self._last[1]
        self._last = None
        start = time.perf_counter()
        buffers = {s: {n: pulled.tensors[n].detach() for n in pulled.buffer_names[s]} for s in self.servers}
        sent = sum(b.nbytes for per_server in buffers.values() for b in per_server.values())
        if not self.explicit_push:
            self.transport.commit(context_id, pulled.versions, buffers)
            sent += sum(b.nbytes for b in self.buckets)
        else:
            grads = dist_autograd.get_gradients(context_id)
            payloads = {
                s: [
                    self.wire.encode(grads[flat] if flat in grads else torch.zeros_like(flat), bucket.index)
                    for bucket, flat in zip(self.server_buckets[s], pulled.flats[s])
                ]
                for s in self.servers
            }
            sent += sum(self.wire.nbytes(p) for per_server in payloads.values() for p in per_server)
            self.transport.push(pulled.versions, payloads, buffers)
        self.metrics.committed(start, sent)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return to_state_dict(self.model.module, self.transport.state_dict())
