"""Worker side of the parameter-server strategy: pull, functional forward, commit.

`PSStrategy.model` wraps the user's module. Its forward pulls every server's
buckets with one asynchronous RPC per server (inside a dist_autograd context
the pulled tensors are recorded, so `dist_autograd.backward` sends each
bucket's gradient back to its server), then runs the module on views of them
with `torch.func.functional_call`. `step(context_id)` asks every server to
apply that context's gradients and waits for the new versions. With
compression the pulled buckets are local leaves instead: `step` reads their
gradients from the context, encodes them (`ps.wire`) and pushes them.
"""
from __future__ import annotations

import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.func import functional_call

from gradsync.cluster import Cluster
from gradsync.config import server_name
from gradsync.ps import server as ps_server
from gradsync.ps.buckets import ModelSpec, assign_buffers, plan_buckets
from gradsync.ps.wire import make_wire
from gradsync.worker.metrics import StepMetrics
from gradsync.worker.model_state import named_tensors, to_state_dict


def current_context_id() -> int | None:
    """The id of the active dist_autograd context, or None outside one."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:
        return None


def _wait(futures: dict[int, torch.futures.Future], what: str, timeout: float) -> dict[int, object]:
    """Wait for one future per server; the error names the operation, server and elapsed time."""
    start = time.monotonic()
    results = {}
    for server, fut in futures.items():
        try:
            result = fut.wait()
        except Exception as e:
            error = e
        else:
            # torch RPC hands an exception set on an async_execution future back as a value
            if not isinstance(result, BaseException):
                results[server] = result
                continue
            error = result
        elapsed = time.monotonic() - start
        raise RuntimeError(
            f"{what} on {server_name(server)} failed after {elapsed:.1f} s (step timeout {timeout:.0f} s): {error}"
        ) from error
    return results


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
        self.timeout = self.config.step_timeout
        self.metrics = StepMetrics()
        params, buffers = named_tensors(module)
        self.spec = ModelSpec.of(params, buffers)
        cap = int(self.config.bucket_cap_mb * 2**20)
        self.buckets = plan_buckets(self.spec.params, self.config.servers, cap)
        self.buffer_server = assign_buffers(self.spec.buffers, self.config.servers)
        self.servers = sorted({b.server for b in self.buckets} | set(self.buffer_server.values()))
        self.wire = make_wire(self.config.compression)
        # uncompressed, gradients ride the distributed backward; compressed, step() encodes and pushes them
        self.explicit_push = self.config.compression != "none"
        self._register(params, buffers, optimizer_cls, optimizer_kwargs)
        for p in params.values():  # the servers own the values now; the local copies are never used
            p.requires_grad_(False)
        self.model = PSModel(module, self)
        self._last: tuple[int | None, _Pulled] | None = None

    def _register(self, params, buffers, optimizer_cls, optimizer_kwargs) -> None:
        futures = {}
        for s in self.servers:
            setup = None
            if self.worker == 0:
                mine = [b for b in self.buckets if b.server == s]
                my_buffers = {n: t for n, t in buffers.items() if self.buffer_server[n] == s}
                setup = ps_server.make_setup(mine, params, my_buffers, optimizer_cls, optimizer_kwargs)
            futures[s] = rpc.rpc_async(
                server_name(s),
                ps_server.rpc_register,
                args=(self.worker, self.spec, setup),
                timeout=self.config.startup_timeout,
            )
        _wait(futures, "registering the model", self.config.startup_timeout)

    def pull(self, context_id: int | None) -> _Pulled:
        """Fetch every server's buckets (once per context; a second forward reuses them)."""
        if context_id is not None and self._last is not None and self._last[0] == context_id:
            return self._last[1]
        start = time.perf_counter()
        recorded = None if self.explicit_push else context_id
        futures = {
            s: rpc.rpc_async(server_name(s), ps_server.rpc_pull, args=(self.worker, recorded), timeout=self.timeout)
            for s in self.servers
        }
        results = _wait(futures, "pull", self.timeout)
        tensors, versions, buffer_names, all_flats, received = {}, {}, {}, {}, 0
        for s, (version, flats, buffers) in results.items():
            versions[s] = version
            if self.explicit_push and context_id is not None:
                flats = [f.requires_grad_(True) for f in flats]  # local leaves: backward leaves their grads here
            all_flats[s] = flats
            for bucket, flat in zip(self._buckets_of(s), flats):
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
        grads = dist_autograd.get_gradients(context_id) if self.explicit_push else None
        futures, sent = {}, 0
        for s in self.servers:
            buffers = {n: pulled.tensors[n].detach() for n in pulled.buffer_names[s]}
            sent += sum(b.nbytes for b in buffers.values())
            if grads is None:
                args = (self.worker, context_id, pulled.versions[s], buffers)
                futures[s] = rpc.rpc_async(server_name(s), ps_server.rpc_commit, args=args, timeout=self.timeout)
                sent += sum(b.nbytes for b in self._buckets_of(s))
                continue
            payloads = [
                self.wire.encode(grads[flat] if flat in grads else torch.zeros_like(flat), bucket.index)
                for bucket, flat in zip(self._buckets_of(s), pulled.flats[s])
            ]
            sent += sum(self.wire.nbytes(p) for p in payloads)
            args = (self.worker, pulled.versions[s], payloads, buffers)
            futures[s] = rpc.rpc_async(server_name(s), ps_server.rpc_push, args=args, timeout=self.timeout)
        _wait(futures, "commit", self.timeout)
        self.metrics.committed(start, sent)

    def _buckets_of(self, server: int) -> list:
        return [b for b in self.buckets if b.server == server]

    def state_dict(self) -> dict[str, torch.Tensor]:
        futures = {s: rpc.rpc_async(server_name(s), ps_server.rpc_state_dict, timeout=self.timeout) for s in self.servers}
        values = {}
        for part in _wait(futures, "state_dict", self.timeout).values():
            values.update(part)
        return to_state_dict(self.model.module, values)
