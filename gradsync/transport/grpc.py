"""gRPC: every server's endpoint for the world outside the job, and the ps transport without TensorPipe.

Server side: `start_endpoint` serves a `ParameterServer` over gRPC
(`gradsync.proto.service`) and publishes the address (run directory and
rendezvous store); in a `--transport grpc` job, `register_from_store` takes
the model the workers left in the store. Worker side: `GrpcTransport` pulls
and pushes through `gradsync.client.Client`, by bucket entry key (a split
parameter's piece is `name[start:end]`), converting to and from the flat
buckets of the shared plan at this boundary.

Settings come from the environment the launcher (or the user, under torchrun)
sets: GRADSYNC_RUN_DIR (default ./runs/<job id>), GRADSYNC_GRPC_HOST (default
127.0.0.1: nothing listens beyond loopback unless asked), GRADSYNC_GRPC_PORT
(default 0, a free port; server i uses port + i), GRADSYNC_TOKEN (default: one
token per job, made by the first server and shared through the store), and
GRADSYNC_TLS_CERT / GRADSYNC_TLS_KEY for TLS.
"""
from __future__ import annotations

import io
import os

import torch
import torch.distributed as dist

from gradsync.config import JobConfig, StoreKeys
from gradsync.core.buckets import Bucket, ModelSpec
from gradsync.proto.endpoints import new_token, write_endpoints
from gradsync.ps.server import ParameterServer
from gradsync.ps.shard import Snapshot



def run_dir() -> str:
    """This job's run directory (created if missing)."""
    path = os.environ.get("GRADSYNC_RUN_DIR") or os.path.join("runs", os.environ.get("TORCHELASTIC_RUN_ID", "local"))
    os.makedirs(path, exist_ok=True)
    return path


def job_token(store: dist.Store) -> str:
    """The job's bearer token: GRADSYNC_TOKEN, else the first server's, shared through the store."""
    given = os.environ.get("GRADSYNC_TOKEN")
    if given:
        return given
    return store.compare_set(StoreKeys.TOKEN, "", new_token()).decode()


def start_endpoint(server: ParameterServer, store: dist.Store, step_timeout: float):
    """Serve `server` over gRPC and write its address and the token to the run directory."""
    from gradsync.proto.service import serve_grpc

    directory = run_dir()
    port = int(os.environ.get("GRADSYNC_GRPC_PORT", "0"))
    token = job_token(store)
    endpoint = serve_grpc(
        server,
        host=os.environ.get("GRADSYNC_GRPC_HOST", "127.0.0.1"),
        port=port + server.shard_id if port else 0,
        token=token,
        tls_cert=os.environ.get("GRADSYNC_TLS_CERT"),
        tls_key=os.environ.get("GRADSYNC_TLS_KEY"),
        checkpoint_dir=os.path.join(directory, "checkpoints"),
        step_timeout=step_timeout,
    )
    write_endpoints(directory, server.shard_id, endpoint.address, token)
    store.set(StoreKeys.GRPC_ADDRESS.format(server.shard_id), endpoint.address)
    return endpoint


def to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)  # the store is the job's trusted control plane


def register_from_store(server: ParameterServer, store: dist.Store, config: JobConfig) -> None:
    """On a server of a grpc-transport job: take the model that the workers left in the store,
    register it, and answer in the store (the frozen parameters, or the error text)."""
    shard = server.shard_id
    keys = [StoreKeys.GRPC_SETUP.format(shard)] + [StoreKeys.GRPC_SPEC.format(shard, w) for w in range(config.num_workers)]
    store.wait(keys)
    setup = from_bytes(store.get(StoreKeys.GRPC_SETUP.format(shard)))
    futures = [
        server.register(w, from_bytes(store.get(StoreKeys.GRPC_SPEC.format(shard, w))), setup if w == 0 else None)
        for w in range(config.num_workers)
    ]
    try:
        answer = [fut.wait() for fut in futures][0]
    except Exception as e:
        answer = str(e)
    store.set(StoreKeys.GRPC_REGISTERED.format(shard), to_bytes(answer))


class GrpcTransport:
    """The worker side: pull and push through each server's gRPC endpoint."""

    def __init__(self, config: JobConfig, store: dist.Store, server_buckets: dict[int, list[Bucket]],
                 owner: dict[str, int]):
        from gradsync.client import Client

        self.config = config
        self.store = store
        self.worker = config.worker_rank
        self.servers = list(server_buckets)
        self.server_buckets = server_buckets
        self.owner = owner
        store.wait([StoreKeys.GRPC_ADDRESS.format(s) for s in self.servers])  # bounded by the store's start-up timeout
        addresses = {s: store.get(StoreKeys.GRPC_ADDRESS.format(s)).decode() for s in self.servers}
        self.client = Client(addresses, token=job_token(store), timeout=config.step_timeout)

    def register(self, spec: ModelSpec, setups: dict[int, dict | None]) -> dict[str, torch.Tensor]:
        self.buffer_names = {t.name for t in spec.buffers}
        for s in self.servers:
            if setups[s] is not None:
                self.store.set(StoreKeys.GRPC_SETUP.format(s), to_bytes(setups[s]))
            self.store.set(StoreKeys.GRPC_SPEC.format(s, self.worker), to_bytes(spec))
        self.store.wait([StoreKeys.GRPC_REGISTERED.format(s) for s in self.servers])
        frozen = {}
        for s in self.servers:
            answer = from_bytes(self.store.get(StoreKeys.GRPC_REGISTERED.format(s)))
            if isinstance(answer, str):
                raise RuntimeError(f"registering the model on ps{s} failed: {answer}")
            frozen.update(answer)
        return frozen

    def pull(self) -> dict[int, Snapshot]:
        tensors, versions = self.client.pull_versioned(whole=False)
        return {s: self._snapshot(s, versions[s], tensors) for s in self.servers}

    def _snapshot(self, s: int, version: int, tensors: dict[str, torch.Tensor]) -> Snapshot:
        flats = [torch.cat([tensors[e.key].reshape(-1) for e in b.entries]) for b in self.server_buckets[s]]
        buffers = {n: t for n, t in tensors.items() if n in self.buffer_names and self.owner[n] == s}
        return Snapshot(version, flats, buffers)

    def push(self, versions, payloads, absent, buffers, rows=None) -> dict[int, Snapshot]:
        named: dict[str, torch.Tensor] = {}
        for s in self.servers:
            for bucket, flat, missing in zip(self.server_buckets[s], payloads[s], absent[s]):
                if flat is not None:
                    named.update({e.key: e.view(flat) for i, e in enumerate(bucket.entries) if i not in missing})
            named.update(buffers[s])
        self.client.push(named, versions, self.worker)
        return self.pull()

    def state(self) -> dict[int, tuple]:
        tensors, versions = self.client.pull_versioned(whole=False)
        out = {}
        for s in self.servers:
            snap = self._snapshot(s, versions[s], tensors)
            named = {n: t for n, t in tensors.items() if self.owner.get(n) == s}
            out[s] = (snap.version, snap.flats, named)
        return out

    def stats(self) -> dict[int, dict]:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()
