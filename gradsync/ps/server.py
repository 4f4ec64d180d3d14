"""The parameter server: registration barrier, pulls and commits over torch RPC.

One `ParameterServer` lives in each server process. Workers reach it through
the module-level `rpc_*` functions below (torch RPC pickles functions by module
path). The server waits until all W workers have registered the same model,
builds its `ShardState` from worker 0's values, then serves pulls (consistent
copies, recorded by distributed autograd) and commits (gradients read from the
worker's distributed autograd context and handed to the consistency rule), or,
with compression, pushes of gradients the worker encoded itself.
"""
from __future__ import annotations

import dataclasses
import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from gradsync.ps.buckets import Bucket, ModelSpec
from gradsync.ps.consistency import RULES
from gradsync.ps.shard import GradientError, ShardState
from gradsync.ps.wire import make_wire


class ParameterServer:
    """State of one server process; methods are thread-safe."""

    def __init__(self, shard_id: int, num_workers: int, mode: str, nonfinite: str, compression: str = "none",
                 device: str = "cpu"):
        self.shard_id = shard_id
        self.device = _usable_device(device)
        self.wire = make_wire(compression)
        self.num_workers = num_workers
        self.mode = mode
        self.nonfinite = nonfinite
        self.shard: ShardState | None = None
        self.rule = None
        self._lock = threading.Lock()
        self._registrations: dict[int, tuple[ModelSpec, torch.futures.Future]] = {}
        self._setup: dict | None = None
        self._pulled: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.ready = threading.Event()

    def register(self, worker: int, spec: ModelSpec, setup: dict | None) -> torch.futures.Future:
        """Barrier of all W workers; worker 0 brings `setup` (buckets, values, optimizer).

        The returned future fails on every worker when any worker's model differs from worker 0's.
        """
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self.ready.is_set() or worker in self._registrations:
                fut.set_exception(RuntimeError(f"worker {worker} registered twice with server {self.shard_id}"))
                return fut
            self._registrations[worker] = (spec, fut)
            if setup is not None:
                self._setup = setup
            if len(self._registrations) < self.num_workers:
                return fut
            registrations = dict(self._registrations)
            error = self._mismatch(registrations)
            if error is None:
                s = self._setup
                self.shard = ShardState(
                    self.shard_id, s["buckets"], s["params"], s["buffers"], s["optimizer_cls"], s["optimizer_kwargs"],
                    self.device,
                )
                self.rule = RULES[self.mode](self.shard, self.num_workers, self.nonfinite)
                self._setup = None
                self.ready.set()
        for _, waiting in registrations.values():
            if error is None:
                waiting.set_result(None)
            else:
                waiting.set_exception(error)
        return fut

    def _mismatch(self, registrations: dict[int, tuple[ModelSpec, torch.futures.Future]]) -> Exception | None:
        if 0 not in registrations or self._setup is None:
            return RuntimeError(f"server {self.shard_id}: worker 0 did not send the model's initial values")
        reference = registrations[0][0]
        for worker in sorted(registrations):
            diff = reference.difference(registrations[worker][0])
            if diff is not None:
                return ValueError(
                    f"worker {worker}'s model differs from worker 0's: {diff}. Every worker must build the "
                    "same model (same classes, same constructor arguments)"
                )
        return None

    def pull(self, worker: int, context_id: int | None) -> tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]:
        """A consistent copy of this shard; inside a context the copies are the gradient leaves."""
        shard = self._shard()
        with shard.lock:
            version, flats, buffers = shard.snapshot()
        if context_id is not None:
            flats = [f.requires_grad_(True) for f in flats]
            with self._lock:
                self._pulled[worker] = (context_id, flats)
        return version, flats, buffers

    def commit(self, worker: int, context_id: int, pulled_version: int, buffers: dict) -> torch.futures.Future:
        """Hand the gradients of `context_id` to the consistency rule; resolves to the new version."""
        with self._lock:
            cid, leaves = self._pulled.pop(worker, (None, None))
        if cid != context_id:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_exception(
                GradientError(
                    f"worker {worker} committed context {context_id} to server {self.shard_id}, which served "
                    f"its last pull in context {cid}: call trainer.model(...) inside the same "
                    "dist_autograd.context() as trainer.step(context_id)"
                )
            )
            return fut
        grads_by_leaf = dist_autograd.get_gradients(context_id)
        grads = [grads_by_leaf.get(leaf) for leaf in leaves]
        return self.rule.commit(worker, pulled_version, grads, buffers)

    def push(self, worker: int, pulled_version: int, payloads: list, buffers: dict) -> torch.futures.Future:
        """Gradients the worker read from its context and encoded in this job's wire format (compression)."""
        return self.rule.commit(worker, pulled_version, payloads, buffers, self.wire)

    def state_dict(self) -> dict[str, torch.Tensor]:
        shard = self._shard()
        with shard.lock:
            return shard.state_dict()

    def _shard(self) -> ShardState:
        if self.shard is None:
            raise RuntimeError(f"server {self.shard_id} has no model yet: every worker must create the Trainer")
        return self.shard


def _usable_device(device: str) -> torch.device:
    """The server's shard device; refuses CUDA on a machine without it."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"server_device {device!r} asked for, but this server has no CUDA device: use --server-device cpu"
        )
    return torch.device(device)


_SERVER: ParameterServer | None = None


def install(server: ParameterServer) -> None:
    """Make `server` the target of this process's RPC handlers."""
    global _SERVER
    _SERVER = server


def _server() -> ParameterServer:
    if _SERVER is None:
        raise RuntimeError("this process is not a gradsync parameter server")
    return _SERVER


@rpc.functions.async_execution
def rpc_register(worker: int, spec: ModelSpec, setup: dict | None) -> torch.futures.Future:
    return _server().register(worker, spec, setup)


def rpc_pull(worker: int, context_id: int | None):
    return _server().pull(worker, context_id)


@rpc.functions.async_execution
def rpc_commit(worker: int, context_id: int, pulled_version: int, buffers: dict) -> torch.futures.Future:
    return _server().commit(worker, context_id, pulled_version, buffers)


@rpc.functions.async_execution
def rpc_push(worker: int, pulled_version: int, payloads: list, buffers: dict) -> torch.futures.Future:
    return _server().push(worker, pulled_version, payloads, buffers)


def rpc_state_dict() -> dict[str, torch.Tensor]:
    return _server().state_dict()


def make_setup(buckets: list[Bucket], params, buffers, optimizer_cls, optimizer_kwargs) -> dict:
    """What worker 0 sends one server at registration: its buckets' values and the optimizer."""
    names = {e.name for b in buckets for e in b.entries}
    return {
        "buckets": buckets,
        "params": {n: t.detach().cpu() for n, t in params.items() if n in names},
        "buffers": {n: t.detach().cpu() for n, t in buffers.items()},
        "optimizer_cls": optimizer_cls,
        "optimizer_kwargs": optimizer_kwargs,
    }


def rpc_stats() -> dict:
    """This server's counters (version, pushes applied/rejected, staleness, bytes)."""
    shard = _server()._shard()
    with shard.lock:
        stats = dataclasses.asdict(shard.stats)
    stats["workers_seen"] = sorted(stats["workers_seen"])
    return stats
