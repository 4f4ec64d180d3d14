"""A ready in-process ParameterServer behind a gRPC endpoint, for the gRPC and proto tests: the server, its
endpoint and clients, the job's transports, and its workers' calls made at once from threads."""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.transport.grpc.client import Client
from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.transport.grpc.server import serve_grpc
from gradsync.core.buckets import ModelSpec, plan_buckets
from gradsync.ps.messages import Setup
from gradsync.ps.server import ParameterServer
from gradsync.transport.grpc.endpoint import MEMBER_TOKEN_KEY
from gradsync.transport.grpc.job_calls import GrpcTransport

TOKEN = "test-token-0123456789"  # clients outside the job
MEMBER_TOKEN = "test-member-token-9876543210"  # the job's own workers


def model_state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Parameters and buffers of a small two-layer model (several buckets at a 256-byte cap)."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "fc1.weight": torch.randn(16, 8, generator=g),
        "fc1.bias": torch.randn(16, generator=g),
        "fc2.weight": torch.randn(4, 16, generator=g),
        "fc2.bias": torch.randn(4, generator=g),
    }
    params = {n: p.requires_grad_() for n, p in params.items()}
    buffers = {"norm.running_mean": torch.randn(4, generator=g), "norm.steps": torch.tensor(7)}
    return params, buffers


def make_server(mode: str = "sync", workers: int = 2, lr: float = 0.1, momentum: float = 0.0,
                nonfinite: str = "raise", num_servers: int = 1, shard: int = 0) -> ParameterServer:
    """A ParameterServer whose W workers have all registered the model of `model_state()`."""
    params, buffers = model_state()
    spec = ModelSpec.of(params, buffers)
    buckets = [b for b in plan_buckets(spec.params, num_servers, cap_bytes=256) if b.server == shard]
    mine = {e.key for b in buckets for e in b.entries}
    setup = Setup.of(buckets, params, {n: t for n, t in buffers.items() if shard == 0}, {},
                     OptimizerSpec.one_group(torch.optim.SGD, {"lr": lr, "momentum": momentum}))
    server = ParameterServer(shard, workers, mode, nonfinite)
    futures = [server.register(w, spec, setup if w == 0 else None) for w in range(workers)]
    for f in futures:
        f.wait()
    assert server.ready.is_set() and set(server.shard.params) == mine
    return server


@contextlib.contextmanager
def served(server: ParameterServer, timeout: float = 10.0, member: bool = False, **kwargs):
    """(endpoint, client) for `server` on 127.0.0.1, stopped afterwards; the client holds the outside token,
    or with `member` the job members' token."""
    endpoint = serve_grpc(server, token=TOKEN, member_token=MEMBER_TOKEN, **kwargs)
    client = Client(endpoint.address, token=MEMBER_TOKEN if member else TOKEN, timeout=timeout)
    try:
        yield endpoint, client
    finally:
        client.close()
        endpoint.stop(0.5)


def job_transport(endpoint, server: ParameterServer, worker: int) -> GrpcTransport:
    """Worker `worker`'s GrpcTransport to `server` (served at `endpoint`), as in a one-server grpc job."""
    store = dist.HashStore()
    store.set(StoreKeys.GRPC_ADDRESS.format(0), endpoint.address)
    store.set(StoreKeys.TOKEN, TOKEN)
    store.set(MEMBER_TOKEN_KEY, MEMBER_TOKEN)
    config = JobConfig(strategy="ps", servers=1, rank=1 + worker, world_size=1 + server.num_workers,
                       transport="grpc", step_timeout=10.0)
    return GrpcTransport(config, store, {0: server.shard.buckets})


@contextlib.contextmanager
def job_transports(endpoint, server: ParameterServer, workers: int):
    """The GrpcTransports of workers 0..workers-1 (`job_transport`), closed afterwards."""
    transports = [job_transport(endpoint, server, w) for w in range(workers)]
    try:
        yield transports
    finally:
        for t in transports:
            t.close()


def each_worker(call, workers: int, join_s: float = 30.0) -> None:
    """`call(w)` for every worker w at once, one thread each (a sync step needs them all); waits up to `join_s`
    seconds for every thread (the test's assertions on what the calls returned then name one that did not end)."""
    threads = [threading.Thread(target=call, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
