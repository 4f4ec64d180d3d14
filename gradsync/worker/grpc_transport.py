"""Worker-to-server calls over gRPC: the ps strategy without TensorPipe (`--transport grpc`).

Servers publish their gRPC addresses in the rendezvous store; the model is
registered through the store too (worker 0's values and optimizer, every
worker's spec), and the servers answer there. Pulls and pushes then go through
`gradsync.client.Client`: the pulled buckets are local leaves of the worker's
dist_autograd context, and `push` sends their gradients, plus the updated
buffers, by name.
"""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from gradsync.client import Client
from gradsync.config import JobConfig
from gradsync.ps.buckets import Bucket
from gradsync.ps.endpoint import ADDRESS_KEY, job_token

SETUP_KEY = "gradsync/grpc/setup/{}"
SPEC_KEY = "gradsync/grpc/spec/{}/{}"
REGISTERED_KEY = "gradsync/grpc/registered/{}"


def to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)  # the store is the job's trusted control plane


class GrpcTransport:
    """Pull and push through each server's gRPC endpoint."""

    def __init__(self, config: JobConfig, store: dist.Store, server_buckets: dict[int, list[Bucket]],
                 buffer_server: dict[str, int]):
        self.config = config
        self.store = store
        self.worker = config.worker_rank
        self.servers = list(server_buckets)
        self.server_buckets = server_buckets
        self.buffer_server = buffer_server
        self.records_gradients = False
        store.wait([ADDRESS_KEY.format(s) for s in self.servers])  # bounded by the store's start-up timeout
        addresses = {s: store.get(ADDRESS_KEY.format(s)).decode() for s in self.servers}
        self.client = Client(addresses, token=job_token(store), timeout=config.step_timeout)

    def register(self, spec, setups: dict[int, dict | None]) -> None:
        for s in self.servers:
            if setups[s] is not None:
                self.store.set(SETUP_KEY.format(s), to_bytes(setups[s]))
            self.store.set(SPEC_KEY.format(s, self.worker), to_bytes(spec))
        self.store.wait([REGISTERED_KEY.format(s) for s in self.servers])
        for s in self.servers:
            answer = self.store.get(REGISTERED_KEY.format(s)).decode()
            if answer != "ok":
                raise RuntimeError(f"registering the model on ps{s} failed: {answer}")

    def pull(self, context_id: int | None) -> dict[int, tuple[int, list[torch.Tensor], dict]]:
        tensors, versions = self.client.pull_versioned()
        out = {}
        for s in self.servers:
            flats = [b.flatten(tensors) for b in self.server_buckets[s]]
            buffers = {n: tensors[n] for n, owner in self.buffer_server.items() if owner == s}
            out[s] = (versions[s], flats, buffers)
        return out

    def push(self, versions: dict[int, int], payloads: dict[int, list], buffers: dict[int, dict]) -> None:
        named: dict[str, torch.Tensor] = {}
        for s in self.servers:
            for bucket, grad in zip(self.server_buckets[s], payloads[s]):
                named.update(bucket.views(grad))
            named.update(buffers[s])
        self.client.push(named, versions, self.worker)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.client.pull()


def register_from_store(server, store: dist.Store, config: JobConfig) -> None:
    """On a server of a grpc-transport job: take the model that the workers left in the store,
    register it as the RPC path would, and answer in the store ('ok' or the error)."""
    shard = server.shard_id
    keys = [SETUP_KEY.format(shard)] + [SPEC_KEY.format(shard, w) for w in range(config.num_workers)]
    store.wait(keys)
    setup = from_bytes(store.get(SETUP_KEY.format(shard)))
    futures = [
        server.register(w, from_bytes(store.get(SPEC_KEY.format(shard, w))), setup if w == 0 else None)
        for w in range(config.num_workers)
    ]
    try:
        for fut in futures:
            fut.wait()
        answer = "ok"
    except Exception as e:
        answer = str(e)
    store.set(REGISTERED_KEY.format(shard), answer)
