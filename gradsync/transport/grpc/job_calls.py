"""gRPC as the ps transport: the job's workers reach the servers without TensorPipe.

Rank side: `GrpcRank` starts no RPC agent (distributed autograd contexts still
work without one); on a server, once its endpoint is up
(`gradsync.transport.grpc.endpoint`), `register_from_store` takes the model the
workers left in the store (plain data only: `store_data`). Worker side:
`GrpcTransport` uses the job calls of the service, which carry the flat buckets
of the shared plan by index (no names, no conversion): one JobPull stream per
server before the first step, then one JobPush stream per server per step,
whose reply is the server's snapshot after the step, which the next forward uses
without a pull (as over torch RPC); a sync step without clipping or a GradScaler is a
pipeline inside that stream (`JobPushHeader.pieces`: each bucket applied and sent
back while the next is still coming up). Worker 0 times the link with JobProbe calls
for the piece size (`worker.pipeline.piece_size`). Its capabilities: the ps strategy, no
compression, no row-wise tables, no joining workers
(`gradsync.core.transport_capabilities`).
"""

from __future__ import annotations

import threading
import time
from typing import cast

import grpc
import torch
import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core import settings
from gradsync.core.buckets import Bucket, ModelSpec
from gradsync.core.job_names import StoreKeys, server_name
from gradsync.core.torch_internals import start_dist_autograd
from gradsync.core.transport_capabilities import capabilities
from gradsync.metrics.timeline import HEAD, PieceEvents, Timeline
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import tensor_codec
from gradsync.ps.messages import Partial, Piece, PipelineHead, Push, Setup, Snapshot
from gradsync.ps.server import ParameterServer
from gradsync.transport.base import PROBE_BYTES, RankTransport, WorkerTransport, link_rate
from gradsync.transport.grpc.client import Client
from gradsync.transport.grpc.endpoint import worker_token
from gradsync.transport.grpc.plain_data import from_bytes, plain_setup, put, setup_from_plain, take, to_bytes
from gradsync.transport.grpc.reply_streams import chunk_of, read_stream
from gradsync.transport.grpc.servicer import SERVICE


def register_from_store(server: ParameterServer, store: dist.Store, config: JobConfig) -> None:
    """On a server of a grpc-transport job: take the model that the workers left in the store,
    register it, and answer in the store (the frozen parameters, or the error text)."""
    shard = server.shard_id
    keys = [StoreKeys.GRPC_SETUP.format(shard)]
    keys += [StoreKeys.GRPC_SPEC.format(shard, w) for w in range(config.num_workers)]
    store.wait(keys)
    try:
        setup = setup_from_plain(take(store, StoreKeys.GRPC_SETUP.format(shard), f"the setup of server {shard}"))
        specs = [
            take(store, StoreKeys.GRPC_SPEC.format(shard, w), f"the model spec of worker {w}")
            for w in range(config.num_workers)
        ]
        futures = [server.register(w, spec, setup if w == 0 else None) for w, spec in enumerate(specs)]
        answer = [fut.wait() for fut in futures][0]
    except Exception as e:
        answer = str(e)
    put(store, StoreKeys.GRPC_REGISTERED.format(shard), answer)


def _client(config: JobConfig, store: dist.Store) -> Client:
    """A client of every server of the job, with the member token (with TLS, trusting the servers'
    certificate); waits for their addresses within the store's start-up timeout."""
    servers = range(config.servers)
    store.wait([StoreKeys.GRPC_ADDRESS.format(s) for s in servers])
    addresses = {s: store.get(StoreKeys.GRPC_ADDRESS.format(s)).decode() for s in servers}
    return Client(addresses, token=worker_token(store), timeout=config.step_timeout, root_cert=settings.TLS_CERT.read())


def read_pieces(
    call, what: str, s: int, arrived=lambda bucket, tensor, stamp: None
) -> tuple[pb.PullHeader, dict[tensor_codec.Key, torch.Tensor]]:
    """A pipelined JobPush's reply (see the .proto): the buckets (`arrived(bucket, tensor, stamp)` after each,
    `stamp` its server's (arrived, applied) when a `PieceStamp` came before it, else None), the PullHeader,
    the buffers."""
    header, stamps = None, {}

    def chunks():
        nonlocal header
        for response in call:
            if (chunk := chunk_of(response)) is not None:
                yield chunk
            elif response.WhichOneof("item") == "stamp":
                stamps[response.stamp.bucket] = (response.stamp.arrived or None, response.stamp.applied or None)
            elif header is None:
                header = response.header
                return
            else:
                raise RuntimeError(f"{what} on {server_name(s)}: a second PullHeader in the reply")

    tensors = {}
    for key, tensor in tensor_codec.decode_each(chunks()):
        tensors[key] = tensor
        arrived(key, tensor, stamps.pop(key, None))
    if header is None:
        raise RuntimeError(f"{what} on {server_name(s)}: the reply ended without its PullHeader")
    tensors.update(tensor_codec.decode(chunks()))
    return header, tensors


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

    def __init__(
        self,
        config: JobConfig,
        store: dist.Store,
        server_buckets: dict[int, list[Bucket]],
        timeline: Timeline | None = None,
        early: bool = True,
    ):
        super().__init__(config, store, server_buckets, timeline, early)
        self.frozen: dict[int, dict[str, torch.Tensor]] = {}
        self.client = _client(config, store)
        snapshot = tensor_codec.message_parser(pb.PullResponse)  # chunks as views of the received bytes
        self._pulls = {
            s: c.unary_stream(
                f"/{SERVICE}/JobPull",
                request_serializer=pb.JobPullRequest.SerializeToString,
                response_deserializer=snapshot,
            )
            for s, c in self.client.channels.items()
        }
        self._pushes = {
            s: c.stream_stream(
                f"/{SERVICE}/JobPush", request_serializer=tensor_codec.serialize, response_deserializer=snapshot
            )
            for s, c in self.client.channels.items()
        }
        self._finishes = {
            s: c.unary_stream(
                f"/{SERVICE}/JobFinish",
                request_serializer=pb.JobFinishRequest.SerializeToString,
                response_deserializer=snapshot,
            )
            for s, c in self.client.channels.items()
        }

    @classmethod
    def bandwidth(cls, config: JobConfig, store: dist.Store) -> float:
        """`link_rate` by JobProbe calls of at most `PROBE_BYTES` (gRPC's default message limit is 4 MB)."""
        client = _client(config, store)
        try:
            probes = {
                s: c.unary_unary(
                    f"/{SERVICE}/JobProbe",
                    request_serializer=pb.PlainData.SerializeToString,
                    response_deserializer=pb.PlainData.FromString,
                )
                for s, c in client.channels.items()
            }

            def timed(s: int, nbytes: int) -> float:
                start = time.perf_counter()
                try:
                    probes[s](
                        pb.PlainData(data=bytes(nbytes)), timeout=config.startup_timeout, metadata=client.metadata
                    )
                except grpc.RpcError as e:
                    raise client.error("JobProbe", s, start, e) from None
                return time.perf_counter() - start

            return link_rate(config.servers, timed, largest=PROBE_BYTES)
        finally:
            client.close()

    def register(self, spec: ModelSpec, setups: dict[int, Setup | None]) -> dict[str, torch.Tensor]:
        for t in spec.params + spec.buffers:  # refused here, not later inside gRPC's sending thread
            try:
                tensor_codec.dtype_name(t.dtype)
            except ValueError as e:
                raise ValueError(f"{t.name!r}: {e}; or use --transport rpc") from None
        for s in self.servers:
            if (setup := setups[s]) is not None:
                put(self.store, StoreKeys.GRPC_SETUP.format(s), plain_setup(setup))
            put(self.store, StoreKeys.GRPC_SPEC.format(s, self.worker), spec)
        self.store.wait([StoreKeys.GRPC_REGISTERED.format(s) for s in self.servers])
        for s in self.servers:
            answer = take(self.store, StoreKeys.GRPC_REGISTERED.format(s), f"the answer of server {s}")
            if isinstance(answer, str):
                raise RuntimeError(f"registering the model on {server_name(s)} failed: {answer}")
            self.frozen[s] = answer
        return {n: t for part in self.frozen.values() for n, t in part.items()}

    def pull(self) -> dict[int, Snapshot]:
        start = time.monotonic()
        calls = {
            s: self._pulls[s](pb.JobPullRequest(), timeout=self.config.step_timeout, metadata=self.client.metadata)
            for s in self.servers
        }
        return {s: self._whole("JobPull", s, call, start) for s, call in calls.items()}

    def push(self, versions: dict[int, int], pushes: dict[int, Push]) -> dict[int, Snapshot | Partial]:
        """One JobPush per server (row gradients do not travel: a grpc job keeps its tables dense)."""
        start = time.monotonic()
        calls = {
            s: self._pushes[s](
                self._step(versions[s], pushes[s]), timeout=self.config.step_timeout, metadata=self.client.metadata
            )
            for s in pushes
        }
        return {s: self._snapshot("JobPush", s, call, start) for s, call in calls.items()}

    def push_pieces(
        self, versions: dict[int, int], heads: dict[int, PipelineHead], pieces: list[Piece]
    ) -> dict[int, Snapshot]:
        """A sync step as a pipeline: per server one JobPush with `pieces` (see the .proto) carries the head's
        buffers and options, then the server's buckets in the order given; the server applies each bucket as soon
        as every worker's part of it is in and sends it back at once, while later buckets still come up (both
        directions of the stream at once, at most `self.window` pieces unanswered per server)."""
        start = time.monotonic()
        slots = {s: threading.Semaphore(self.window) for s in self.servers}
        lanes: dict[tuple, PieceEvents | None] = {}  # the step timeline's, by (server, bucket or HEAD)
        calls = {
            s: self._pushes[s](
                self._pipelined(s, versions[s], heads[s], [p for p in pieces if p.server == s], slots[s], lanes),
                timeout=self.config.step_timeout,
                metadata=self.client.metadata,
            )
            for s in self.servers
        }
        replies: dict[int, Snapshot | BaseException] = {}

        def arrived(s: int, bucket: int, tensor: torch.Tensor, stamp: tuple | None) -> None:
            slots[s].release()
            events = lanes.get((s, bucket))
            if events is not None:
                events.returned(tensor.nbytes, *(stamp or ()))

        def read(s: int) -> None:
            try:
                replies[s] = reply = self._whole("JobPush", s, calls[s], start, lambda *bucket: arrived(s, *bucket))
                head = lanes.get((s, HEAD))
                if head is not None:
                    head.returned(sum(t.nbytes for t in reply.buffers.values()))
            except BaseException as e:  # noqa: BLE001 -- raised below, in the caller's thread
                replies[s] = e

        readers = [
            threading.Thread(target=read, args=(s,), name=f"JobPush replies of {server_name(s)}", daemon=True)
            for s in self.servers
        ]
        for t in readers:
            t.start()
        for t in readers:  # each reply stream ends by its call's deadline, the step timeout
            t.join(self.config.step_timeout + 5)
        for s in self.servers:
            if not isinstance(reply := replies.get(s), Snapshot):
                raise reply or TimeoutError(
                    f"JobPush on {server_name(s)}: no reply {self.config.step_timeout:g} s after the step timeout"
                )
        return cast("dict[int, Snapshot]", replies)  # every one a Snapshot (above)

    def finish(self, versions: dict[int, int], coefficient: float | None) -> dict[int, Snapshot]:
        """Apply (or, with None, skip) the held step on every server: see `SyncRule.finish`."""
        start = time.monotonic()
        calls = {
            s: self._finishes[s](
                pb.JobFinishRequest(worker=self.worker, version=versions[s], coefficient=coefficient),
                timeout=self.config.step_timeout,
                metadata=self.client.metadata,
            )
            for s in versions
        }
        return {s: self._whole("JobFinish", s, call, start) for s, call in calls.items()}

    def _header(self, version: int, push: Push, absent, pieces: bool = False) -> pb.JobPushRequest:
        """A JobPush's first message: the step's version, absent entries per bucket, the schedule's changed
        options, and whether to hold the step for a joint norm or to pipeline it (with the timeline's stamps)."""
        header = pb.JobPushHeader(
            worker=self.worker,
            version=version,
            pieces=pieces,
            timeline=pieces and self.timeline.on,
            absent=[pb.AbsentEntries(entries=missing) for missing in absent],
            options=to_bytes(push.options) if push.options else b"",
        )
        if push.agree is not None:
            header.norm_type, header.skip_nonfinite = push.agree.norm_type, push.agree.skip_nonfinite
        return pb.JobPushRequest(header=header)

    def _step(self, version: int, push: Push):
        """The messages of one JobPush: the header, then the bucket gradients by index and the buffers."""
        yield self._header(version, push, push.absent)
        assert push.payloads is not None  # a push that carries its gradients (not a `PipelineHead`)
        tensors: dict[tensor_codec.Key, torch.Tensor] = {
            b: flat for b, flat in enumerate(push.payloads) if flat is not None
        }
        tensors.update(push.buffers)
        yield from tensor_codec.encode_messages(tensors, pb.JobPushRequest)

    def _pipelined(
        self, s: int, version: int, head: Push, pieces: list[Piece], slots: threading.Semaphore, lanes: dict
    ):
        """The messages of one pipelined JobPush: the header, the buffers, then each piece's bucket (one that
        got no gradient is not sent), each once `slots` has room (the server answered one before it: the
        window that keeps W workers' pushes into one server link in step, `transport.base.IN_FLIGHT_MB`).
        Each lane's events go to `lanes` as it leaves (the step timeline)."""
        absent: list[tuple[int, ...]] = [()] * len(self.server_buckets[s])
        for piece in pieces:
            absent[piece.bucket] = piece.absent
        lanes[(s, HEAD)] = self.timeline.lane((s, HEAD))
        yield self._header(version, head, absent, pieces=True)
        yield from tensor_codec.encode_messages(head.buffers, pb.JobPushRequest)
        for piece in pieces:
            if piece.payload is None:  # its reply comes after the stream ends
                continue
            if not slots.acquire(timeout=self.config.step_timeout):  # raising cancels the call: no short step
                raise TimeoutError(f"JobPush on {server_name(s)}: no piece answered in {self.config.step_timeout:g} s")
            lanes[(s, piece.bucket)] = self.timeline.lane((s, piece.bucket))
            yield from tensor_codec.encode_messages({piece.bucket: piece.payload}, pb.JobPushRequest)

    def _whole(self, what: str, s: int, call, start: float, arrived=None) -> Snapshot:
        """`_snapshot` of a call that holds no step (a pull, a finish, a pipelined push): never a `Partial`."""
        return cast(Snapshot, self._snapshot(what, s, call, start, arrived))

    def _snapshot(self, what: str, s: int, call, start: float, arrived=None) -> Snapshot | Partial:
        """Read one server's snapshot stream: its buckets by index, its buffers by name (or a held step's
        `Partial`); with `arrived`, a pipelined JobPush's reply (`read_pieces`), `arrived` after each bucket."""
        try:
            header, tensors = read_stream(call, what, s) if arrived is None else read_pieces(call, what, s, arrived)
        except grpc.RpcError as e:
            raise self.client.error(what, s, start, e) from None
        version = header.version
        if header.HasField("partial"):
            return Partial(version, header.partial)
        buckets = len(self.server_buckets[s])
        if sorted(k for k in tensors if isinstance(k, int)) != list(range(buckets)):
            raise RuntimeError(
                f"{what} on {server_name(s)}: the snapshot holds buckets "
                f"{sorted(k for k in tensors if isinstance(k, int))}, "
                f"expected 0..{buckets - 1}: do the worker and the server hold the same bucket plan?"
            )
        flats = [tensors.pop(b) for b in range(buckets)]
        return Snapshot(version, flats, cast("dict[str, torch.Tensor]", tensors))  # the rest: buffers, by name

    def optimizer_state(self) -> dict[int, dict]:
        return {
            s: from_bytes(self._plain("JobOptimizerState", s, b""), f"{server_name(s)}'s optimizer state")
            for s in self.servers
        }

    def load_optimizer_state(self, parts: dict[int, tuple[dict, list]]) -> None:
        for s in self.servers:
            self._plain("JobLoadOptimizerState", s, to_bytes(parts[s]))

    def load_values(self, number: int, parts: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]]) -> None:
        for s in self.servers:
            self._plain("JobLoadValues", s, to_bytes((number, *parts[s])))
            self.frozen[s].update({n: v.clone() for n, v in parts[s][1].items() if n in self.frozen[s]})

    def _plain(self, method: str, s: int, data: bytes) -> bytes:
        """One unary job call whose request and reply are `PlainData`."""
        start = time.monotonic()
        call = self.client.channels[s].unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=pb.PlainData.SerializeToString,
            response_deserializer=pb.PlainData.FromString,
        )
        try:
            return call(pb.PlainData(data=data), timeout=self.config.step_timeout, metadata=self.client.metadata).data
        except grpc.RpcError as e:
            raise self.client.error(method, s, start, e) from None

    def checkpoint(self, directory: str, base: str | None = None) -> dict[int, tuple[str, int]]:
        return {
            s: from_bytes(
                self._plain("JobCheckpoint", s, to_bytes((directory, base))), f"{server_name(s)}'s checkpoint"
            )
            for s in self.servers
        }

    def state(self) -> dict[int, tuple]:
        return {
            s: (snap.version, snap.flats, {**snap.buffers, **{n: t.clone() for n, t in self.frozen[s].items()}})
            for s, snap in self.pull().items()
        }

    def stats(self) -> dict[int, dict]:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()
