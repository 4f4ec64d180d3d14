"""gRPC as the ps transport: the job's workers reach the servers without TensorPipe.

Rank side: `GrpcRank` starts no RPC agent (distributed autograd contexts still
work without one); on a server, once its endpoint is up
(`gradsync.transport.endpoint`), `register_from_store` takes the model the
workers left in the store (plain data only: `store_data`). Worker side:
`GrpcTransport` uses the job calls of the service, which carry the flat buckets
of the shared plan by index (no names, no conversion): one JobPull stream per
server before the first step, then one JobPush stream per server per step,
whose reply is the server's snapshot after the step, which the next forward uses
without a pull (as over torch RPC). Its capabilities: the ps strategy, no
compression, no row-wise tables, no joining workers
(`gradsync.core.transport_capabilities`).
"""
from __future__ import annotations

import dataclasses
import time

import grpc
import torch
import torch.distributed as dist

from gradsync.config import JobConfig, StoreKeys
from gradsync.core import settings
from gradsync.core.buckets import Bucket, ModelSpec
from gradsync.core.torch_internals import start_dist_autograd
from gradsync.core.transport_capabilities import capabilities
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import tensor_codec
from gradsync.proto.service import SERVICE
from gradsync.proto.store_data import from_bytes, plain_setup, setup_from_plain, to_bytes
from gradsync.ps.messages import Partial, Piece, Push, Setup
from gradsync.ps.server import ParameterServer
from gradsync.ps.shard import Snapshot
from gradsync.remote.client import Client, read_stream
from gradsync.transport.base import RankTransport, WorkerTransport
from gradsync.transport.endpoint import worker_token


def register_from_store(server: ParameterServer, store: dist.Store, config: JobConfig) -> None:
    """On a server of a grpc-transport job: take the model that the workers left in the store,
    register it, and answer in the store (the frozen parameters, or the error text)."""
    shard = server.shard_id
    keys = [StoreKeys.GRPC_SETUP.format(shard)] + [StoreKeys.GRPC_SPEC.format(shard, w) for w in range(config.num_workers)]
    store.wait(keys)
    try:
        setup = setup_from_plain(from_bytes(store.get(StoreKeys.GRPC_SETUP.format(shard)), f"the setup of server {shard}"))
        specs = [from_bytes(store.get(StoreKeys.GRPC_SPEC.format(shard, w)), f"the model spec of worker {w}")
                 for w in range(config.num_workers)]
        futures = [server.register(w, spec, setup if w == 0 else None) for w, spec in enumerate(specs)]
        answer = [fut.wait() for fut in futures][0]
    except Exception as e:
        answer = str(e)
    store.set(StoreKeys.GRPC_REGISTERED.format(shard), to_bytes(answer))


class GrpcRank(RankTransport):
    """No RPC agent on any rank; a server takes the workers' model from the store once its endpoint is up."""

    def start(self, config: JobConfig, store: dist.Store) -> None:
        start_dist_autograd(config.rank)  # gRPC carries everything; contexts still work without an RPC agent

    def serve(self, server: ParameterServer, store: dist.Store, config: JobConfig) -> None:
        register_from_store(server, store, config)

    def leave(self, config: JobConfig, store: dist.Store, timeout: float, at_once: bool = False) -> None:
        """Nothing to stop: the server's endpoint stops with it, a worker's channels with its transport."""


class GrpcTransport(WorkerTransport):
    """The worker side: one streaming call per server for each pull and each step, through the job calls."""

    capabilities = capabilities("grpc")

    def __init__(self, config: JobConfig, store: dist.Store, server_buckets: dict[int, list[Bucket]]):
        super().__init__(config, store, server_buckets)
        self.frozen: dict[int, dict[str, torch.Tensor]] = {}
        store.wait([StoreKeys.GRPC_ADDRESS.format(s) for s in self.servers])  # bounded by the store's start-up timeout
        addresses = {s: store.get(StoreKeys.GRPC_ADDRESS.format(s)).decode() for s in self.servers}
        # with TLS, the job's own workers trust the servers' certificate
        self.client = Client(addresses, token=worker_token(store), timeout=config.step_timeout, root_cert=settings.TLS_CERT.read())
        snapshot = tensor_codec.message_parser(pb.PullResponse)  # chunks as views of the received bytes
        self._pulls = {s: c.unary_stream(f"/{SERVICE}/JobPull", request_serializer=pb.JobPullRequest.SerializeToString,
                                         response_deserializer=snapshot) for s, c in self.client.channels.items()}
        self._pushes = {s: c.stream_stream(f"/{SERVICE}/JobPush", request_serializer=tensor_codec.serialize,
                                           response_deserializer=snapshot) for s, c in self.client.channels.items()}
        self._finishes = {s: c.unary_stream(f"/{SERVICE}/JobFinish",
                                            request_serializer=pb.JobFinishRequest.SerializeToString,
                                            response_deserializer=snapshot) for s, c in self.client.channels.items()}

    def register(self, spec: ModelSpec, setups: dict[int, Setup | None]) -> dict[str, torch.Tensor]:
        for t in spec.params + spec.buffers:  # refused here, not later inside gRPC's sending thread
            try:
                tensor_codec.dtype_name(t.dtype)
            except ValueError as e:
                raise ValueError(f"{t.name!r}: {e}; or use --transport rpc") from None
        for s in self.servers:
            if setups[s] is not None:
                self.store.set(StoreKeys.GRPC_SETUP.format(s), to_bytes(plain_setup(setups[s])))
            self.store.set(StoreKeys.GRPC_SPEC.format(s, self.worker), to_bytes(spec))
        self.store.wait([StoreKeys.GRPC_REGISTERED.format(s) for s in self.servers])
        for s in self.servers:
            answer = from_bytes(self.store.get(StoreKeys.GRPC_REGISTERED.format(s)), f"the answer of server {s}")
            if isinstance(answer, str):
                raise RuntimeError(f"registering the model on ps{s} failed: {answer}")
            self.frozen[s] = answer
        return {n: t for part in self.frozen.values() for n, t in part.items()}

    def pull(self) -> dict[int, Snapshot]:
        start = time.monotonic()
        calls = {s: self._pulls[s](pb.JobPullRequest(), timeout=self.config.step_timeout,
                                   metadata=self.client.metadata) for s in self.servers}
        return {s: self._snapshot("JobPull", s, call, start) for s, call in calls.items()}

    def push(self, versions: dict[int, int], pushes: dict[int, Push]) -> dict[int, Snapshot | Partial]:
        """One JobPush per server (row gradients do not travel: a grpc job keeps its tables dense)."""
        start = time.monotonic()
        calls = {s: self._pushes[s](self._step(versions[s], pushes[s]),
                                    timeout=self.config.step_timeout, metadata=self.client.metadata)
                 for s in self.servers}
        return {s: self._snapshot("JobPush", s, call, start) for s, call in calls.items()}

    def push_pieces(self, versions: dict[int, int], heads: dict[int, Push], pieces: list[Piece]
                    ) -> dict[int, Snapshot]:
        """A sync step's pieces as one push per server, not yet a pipeline (`RpcTransport.push_pieces` is one):
        JobPush streams one whole step in (in chunks) and its snapshot out, and the servicer
        (`proto/service.py`) hands the server the step once it is all in; a pipeline needs it to hand each
        bucket to `ParameterServer.push_piece` as it arrives and stream each answer back."""
        payloads = {s: [None] * len(self.server_buckets[s]) for s in self.servers}
        absent = {s: [()] * len(self.server_buckets[s]) for s in self.servers}
        for piece in pieces:
            payloads[piece.server][piece.bucket], absent[piece.server][piece.bucket] = piece.payload, piece.absent
        return self.push(versions, {s: dataclasses.replace(head, payloads=payloads[s], absent=absent[s])
                                    for s, head in heads.items()})

    def finish(self, versions: dict[int, int], coefficient: float | None) -> dict[int, Snapshot]:
        """Apply (or, with None, skip) the held step on every server: see `SyncRule.finish`."""
        start = time.monotonic()
        calls = {s: self._finishes[s](pb.JobFinishRequest(worker=self.worker, version=versions[s],
                                                          coefficient=coefficient),
                                      timeout=self.config.step_timeout, metadata=self.client.metadata)
                 for s in self.servers}
        return {s: self._snapshot("JobFinish", s, call, start) for s, call in calls.items()}

    def _step(self, version: int, push: Push):
        """The messages of one JobPush: the header (with the schedule's changed options, and whether to hold
        the step for a joint norm), then the bucket gradients by index and the buffers."""
        header = pb.JobPushHeader(worker=self.worker, version=version,
                                  absent=[pb.AbsentEntries(entries=missing) for missing in push.absent],
                                  options=to_bytes(push.options) if push.options else b"")
        if push.agree is not None:
            header.norm_type, header.skip_nonfinite = push.agree.norm_type, push.agree.skip_nonfinite
        yield pb.JobPushRequest(header=header)
        tensors = {b: flat for b, flat in enumerate(push.payloads) if flat is not None}
        tensors.update(push.buffers)
        yield from tensor_codec.encode_messages(tensors, pb.JobPushRequest)

    def _snapshot(self, what: str, s: int, call, start: float) -> Snapshot | Partial:
        """Read one server's snapshot stream: its buckets by index, its buffers by name (or a held step's
        `Partial`)."""
        try:
            header, tensors = read_stream(call, what, s)
        except grpc.RpcError as e:
            raise self.client.error(what, s, start, e) from None
        version = header.version
        if header.HasField("partial"):
            return Partial(version, header.partial)
        buckets = len(self.server_buckets[s])
        if sorted(k for k in tensors if isinstance(k, int)) != list(range(buckets)):
            raise RuntimeError(
                f"{what} on ps{s}: the snapshot holds buckets {sorted(k for k in tensors if isinstance(k, int))}, "
                f"expected 0..{buckets - 1}: do the worker and the server hold the same bucket plan?"
            )
        return Snapshot(version, [tensors.pop(b) for b in range(buckets)], tensors)

    def optimizer_state(self) -> dict[int, dict]:
        return {s: from_bytes(self._plain("JobOptimizerState", s, b""), f"ps{s}'s optimizer state")
                for s in self.servers}

    def load_optimizer_state(self, parts: dict[int, tuple[dict, list]]) -> None:
        for s in self.servers:
            self._plain("JobLoadOptimizerState", s, to_bytes(parts[s]))

    def _plain(self, method: str, s: int, data: bytes) -> bytes:
        """One unary job call whose request and reply are `PlainData`."""
        start = time.monotonic()
        call = self.client.channels[s].unary_unary(f"/{SERVICE}/{method}", request_serializer=pb.PlainData.SerializeToString,
                                                   response_deserializer=pb.PlainData.FromString)
        try:
            return call(pb.PlainData(data=data), timeout=self.config.step_timeout, metadata=self.client.metadata).data
        except grpc.RpcError as e:
            raise self.client.error(method, s, start, e) from None

    def checkpoint(self, directory: str) -> dict[int, tuple[str, int]]:
        return {s: from_bytes(self._plain("JobCheckpoint", s, directory.encode()), f"ps{s}'s checkpoint")
                for s in self.servers}

    def state(self) -> dict[int, tuple]:
        return {s: (snap.version, snap.flats, {**snap.buffers, **{n: t.clone() for n, t in self.frozen[s].items()}})
                for s, snap in self.pull().items()}

    def stats(self) -> dict[int, dict]:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()

