"""The gRPC service of one parameter server: a thin servicer over its public methods (served by
`gradsync.transport.grpc.server.serve_grpc`, with bearer-token auth).

The servicer only translates: messages in, calls on a `ParameterServer`'s
public methods out (its `layout()` for names and limits), results back as
messages. Clients outside the job use
the named calls (Pull, Push: tensors by parameter name, converted to and from
the shard's buckets here); members of the job use the job calls (JobPull,
JobPush: flat buckets by index in the shard's bucket order, handed to
`ParameterServer.pull` / `push` as they are; a pipelined JobPush hands each
bucket to `push_piece` as it arrives and streams it back once applied;
JobProbe: bytes to time the link). A push stream is bounded in bytes
(the shard's size) and in tensor count (its entries, or buckets, plus buffers).
It counts the calls it receives per method (GetStats `calls`). Errors map to status codes:
bad input -> INVALID_ARGUMENT, a server without its model or without a
checkpoint directory -> FAILED_PRECONDITION, a push the consistency rule did
not resolve in time -> DEADLINE_EXCEEDED, a step it refused -> ABORTED; any other
exception of a member's call is the server's own failure -> INTERNAL, recorded as
the job's (`ParameterServer.fault`). Requests are parsed inside the
handlers, so even bytes that are not a protobuf message get INVALID_ARGUMENT.
Every call must carry `authorization: Bearer <token>` metadata; a call without
it is refused with UNAUTHENTICATED before its request is read.

Two credentials tell the job's members from clients outside it: the member
token (known only through the job's rendezvous store) may make every call; the
outside token (the run directory's) may make the named calls only, refused the
job calls with PERMISSION_DENIED. The two are served apart, so that no outside
client can stall the job: at most `outside_calls` outside calls run at once (one
more is refused with RESOURCE_EXHAUSTED) on threads of their own, beside the
members' threads; a call whose client sends nothing of its request stream, or reads
nothing of its reply stream, for its idle limit (outside: `idle_timeout`; members: the
step timeout) is cancelled with DEADLINE_EXCEEDED (`gradsync.transport.grpc.admission`).
An outside Push may not speak for a member: in sync and ssp jobs it is refused, in
async jobs it must name a worker id of its own (num_workers .. 65535, none that a
joined worker registered); every Push carries at least one gradient.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Iterator
from typing import cast

import grpc
import torch
from google.protobuf.message import DecodeError

from gradsync.core.errors import GradientError
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import tensor_codec
from gradsync.ps.layout import ShardLayout
from gradsync.ps.messages import Agreement, Partial, Piece, PipelineHead, Push, Snapshot
from gradsync.transport.grpc.admission import Refused
from gradsync.transport.grpc.plain_data import from_bytes, to_bytes

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
MAX_WORKER_ID = (1 << 16) - 1  # the largest worker id a named Push may carry


class _Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can refuse it with INVALID_ARGUMENT."""

    def __init__(self, kind: str, error: Exception | str):
        self.message = f"the request is not a valid {kind} message ({str(error) or 'undecodable bytes'})"


def request_parser(cls, chunks: bool = False):
    """A request deserializer; with `chunks`, a chunk message becomes a `tensor_codec.Chunk` over its bytes."""
    parse_message = tensor_codec.message_parser(cls) if chunks else cls.FromString

    def parse(data: bytes):
        try:
            return parse_message(data)
        except DecodeError as e:
            return _Malformed(cls.__name__, e)

    return parse


def _parsed(request):
    if isinstance(request, _Malformed):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    return request


class Servicer:
    """Messages <-> calls on one `ParameterServer`."""

    def __init__(self, server, checkpoint_dir: str | None, step_timeout: float, job: str = ""):
        self.server = server
        self.job = job
        self.checkpoint_dir = checkpoint_dir
        self.step_timeout = step_timeout
        self.calls: collections.Counter[str] = collections.Counter()
        self._calls_lock = threading.Lock()

    def count(self, method: str) -> None:
        """Record one call of `method`."""
        with self._calls_lock:
            self.calls[method] += 1

    def failure(self, error: Exception, call: str, worker: int | None = None) -> Exception:
        """What answers a member's call `call` (of `worker`, when known) whose handler raised `error`: a `Refused`
        or the call's own gRPC error as it is; a ValueError, a refusal of what the call carries, with
        INVALID_ARGUMENT; any other, the server's own failure (`ParameterServer.fault`), with INTERNAL."""
        if isinstance(error, (Refused, grpc.RpcError)):
            return error
        if isinstance(error, ValueError):
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return Refused(grpc.StatusCode.INTERNAL, str(self.server.fault(error, call, worker)))

    def _layout(self) -> ShardLayout:
        """The server's layout; refused while it has no model."""
        if not self.server.ready.is_set():
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"server {self.server.shard_id} has no model yet: every worker must create its Trainer first",
            )
        return self.server.layout()

    def health(self, request, context) -> pb.HealthResponse:
        _parsed(request)
        if not self.server.ready.is_set():
            return pb.HealthResponse(shard_id=self.server.shard_id, ready=False, job=self.job)
        shard = self.server.layout()
        pieces = [pb.Piece(name=e.name, shape=e.shape, start=e.start, numel=e.numel) for e in shard.pieces]
        tables = [
            pb.TableInfo(
                name=n,
                shape=t.shape,
                dtype=tensor_codec.dtype_name(t.dtype),
                num_servers=t.num_servers,
                rows_held=t.rows,
            )
            for n, t in shard.tables.items()
        ]
        return pb.HealthResponse(
            shard_id=shard.shard_id,
            ready=True,
            version=shard.version,
            job=self.job,
            parameters=shard.params + shard.frozen,
            buffers=shard.buffers,
            pieces=pieces,
            tables=tables,
        )

    def get_stats(self, request, context) -> pb.GetStatsResponse:
        _parsed(request)
        shard = self._layout()
        with self._calls_lock:
            calls = dict(self.calls)
        tables = [pb.TableStats(name=n, **t) for n, t in self.server.table_stats().items()]
        stats = self.server.stats()
        without = {step: pb.Workers(ids=ids) for step, ids in stats.pop("steps_without").items()}
        return pb.GetStatsResponse(shard_id=shard.shard_id, calls=calls, tables=tables, steps_without=without, **stats)

    def pull(self, request, context) -> Iterator[pb.PullResponse | bytes]:
        request = _parsed(request)
        shard = self._layout()
        unknown = sorted(set(request.names) - set(shard.names))
        if unknown:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"PullRequest.names: server {shard.shard_id} owns no tensor named {unknown[:5]}",
            )
        version, tensors = self.server.pull_named(list(request.names))
        yield pb.PullResponse(header=pb.PullHeader(shard_id=shard.shard_id, version=version))
        yield from tensor_codec.encode_messages(tensors, pb.PullResponse)  # serialized PullResponse(chunk=...)

    def push(self, request_iterator, context, member: bool = True) -> pb.PushResponse:
        shard = self._layout()
        header = _header(request_iterator, "PushRequest", "PushHeader")
        try:
            self._check_pusher(header.worker, member)
            grads = tensor_codec.decode(
                _chunks(request_iterator, "PushRequest"),
                max_bytes=shard.nbytes,
                max_tensors=len(shard.params) + len(shard.buffers),
            )
            buckets = sorted(k for k in grads if isinstance(k, int))
            if buckets:
                raise ValueError(
                    f"PushRequest: Tensor.bucket {buckets[0]} addresses a bucket, which only JobPush takes: "
                    "name each gradient after its parameter"
                )
            if all(n in shard.buffers for n in grads):
                raise ValueError(
                    f"PushRequest carries no gradient ({'only buffers' if grads else 'no tensor'}): name at least "
                    f"one parameter server {shard.shard_id} owns; a push without one would change nothing but the "
                    "version"
                )
            fut = self.server.push_named(header.worker, header.version, grads)
        except Refused as e:
            self.server.rejected(e)
            raise
        except ValueError as e:
            self.server.rejected(e)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        return pb.PushResponse(version=self._applied(fut, header.worker, context).version)

    def _check_pusher(self, worker: int, member: bool) -> None:
        """Refuse a Push header's worker id out of range, and, from outside the job, one that is a member's
        (or any, in a sync or ssp job, whose steps count the job's own workers)."""
        if not 0 <= worker <= MAX_WORKER_ID:
            raise ValueError(f"PushHeader.worker {worker} is not a worker id: expected 0 .. {MAX_WORKER_ID}")
        if member:
            return
        server, workers = self.server, self.server.num_workers
        if server.mode != "async":
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"PushHeader.worker {worker}: server {server.shard_id} runs a {server.mode} job, whose steps take "
                f"the pushes of its {workers} workers only (over JobPush, with the job's member credential); "
                "clients outside the job push to async jobs",
            )
        if worker < workers or server.registered(worker):
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"PushHeader.worker {worker} is a worker of this job: a client outside the job cannot push as one; "
                f"push under an id of your own, {workers} .. {MAX_WORKER_ID}, that no worker of the job holds",
            )

    def pull_rows(self, request, context) -> Iterator[pb.PullResponse | bytes]:
        request = _parsed(request)
        shard = self._layout()
        if request.table not in shard.tables:
            raise Refused(
                grpc.StatusCode.NOT_FOUND,
                f"PullRowsRequest.table: server {shard.shard_id} holds no "
                f"table {request.table!r} (it holds {sorted(shard.tables)})",
            )
        try:
            local = self.server.local_rows(request.table, torch.tensor(list(request.ids), dtype=torch.int64))
        except GradientError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"PullRowsRequest.ids: {e}") from e
        version, rows = self.server.pull_rows(request.table, local)
        yield pb.PullResponse(header=pb.PullHeader(shard_id=shard.shard_id, version=version))
        yield from tensor_codec.encode_messages({request.table: rows}, pb.PullResponse)

    def job_pull(self, request, context) -> Iterator[pb.PullResponse | bytes]:
        _parsed(request)
        shard = self._layout()
        yield from _snapshot_messages(shard.shard_id, self.server.pull())

    def job_push(self, request_iterator, context) -> Iterator[pb.PullResponse | bytes]:
        shard = self._layout()
        header = _header(request_iterator, "JobPushRequest", "JobPushHeader")
        try:
            yield from self._job_push(shard, header, request_iterator, context)
        except Exception as e:
            raise self.failure(e, "push", header.worker)  # noqa: B904 (it may be e itself; e stays the context)

    def _job_push(self, shard: ShardLayout, header, request_iterator, context) -> Iterator[pb.PullResponse | bytes]:
        buckets = shard.buckets
        absent = [tuple(a.entries) for a in header.absent]
        options = from_bytes(header.options, "JobPushHeader.options") if header.options else {}
        if header.pieces:
            yield from self._job_push_pieces(shard, header, request_iterator, absent, options, context)
            return
        try:
            tensors = dict(_job_tensors(shard, request_iterator))
        except ValueError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        payloads = [tensors.pop(b, None) for b in range(buckets)]
        buffers = cast("dict[str, torch.Tensor]", tensors)  # the rest: the buffers, by name
        agree = Agreement(header.norm_type, header.skip_nonfinite) if header.HasField("norm_type") else None
        fut = self.server.push(
            header.worker, header.version, Push(payloads, absent, buffers, options=options, agree=agree)
        )
        applied = self._applied(fut, header.worker, context)
        yield from _snapshot_messages(shard.shard_id, self.server.reply(applied))

    def _job_push_pieces(
        self, shard: ShardLayout, header, request_iterator, absent: list[tuple], options: dict, context
    ) -> Iterator[pb.PullResponse | bytes]:
        """A JobPush with `pieces` (see the .proto): a thread reads the request stream and hands the server the
        step's head (the buffers, before the first bucket) and each bucket as a `Piece` as soon as its last chunk
        is in; this generator sends each bucket's values as soon as the server applied it, then the head's
        reply (the version and buffers after the step). Every wait is bounded by the step timeout."""
        worker, version = header.worker, header.version
        if not self.server.pipelined or header.HasField("norm_type") or len(absent) != shard.buckets:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                (
                    f"JobPushHeader.pieces to server {shard.shard_id} in {self.server.mode} mode, with norm_type "
                    f"{header.norm_type if header.HasField('norm_type') else 'unset'} and {len(absent)} absence lists "
                    f"for its {shard.buckets} buckets: a pipelined step is for sync mode, holds for no norm and lists "
                    "every bucket"
                ),
            )
        answered: queue.SimpleQueue = queue.SimpleQueue()  # (bucket or None for the head, future) or an error

        def give(key, fut) -> None:
            fut.add_done_callback(lambda done: answered.put((key, done)))

        def read() -> None:
            buffers: dict[str, torch.Tensor] = {}
            sent: set | None = None  # the buckets handed over; None until the head is

            def head() -> set:
                give(None, self.server.push(worker, version, PipelineHead(buffers=buffers, options=options)))
                return set()

            try:
                for key, tensor in _job_tensors(shard, request_iterator):
                    if isinstance(key, str):
                        if sent is not None:
                            raise ValueError(
                                f"JobPushRequest: buffer {key!r} came after a bucket; with "
                                "JobPushHeader.pieces the buffers come first"
                            )
                        buffers[key] = tensor
                        continue
                    sent = head() if sent is None else sent
                    give(
                        key,
                        self.server.push_piece(
                            worker, version, Piece(shard.shard_id, key, tensor, absent[key]), stamped=header.timeline
                        ),
                    )
                    sent.add(key)
                sent = head() if sent is None else sent
                for b in sorted(set(range(shard.buckets)) - sent):  # sent no gradient: a piece all the same
                    give(
                        b,
                        self.server.push_piece(
                            worker, version, Piece(shard.shard_id, b, None, absent[b]), stamped=header.timeline
                        ),
                    )
            except Exception as e:  # noqa: BLE001 -- the reply's generator raises it, with its status
                answered.put(e)

        threading.Thread(target=read, name=f"JobPush pieces of worker {worker}", daemon=True).start()
        committed = None
        for _ in range(shard.buckets + 1):
            key, fut = self._answer(answered, worker, context)
            value = self._value(fut)
            if key is None:
                committed = value
                continue
            if header.timeline:  # a `metrics.timeline.Stamped`: the bucket's events on this server first
                value, arrived, applied = value
                yield pb.PullResponse(stamp=pb.PieceStamp(bucket=key, arrived=arrived or 0.0, applied=applied or 0.0))
            yield from tensor_codec.encode_messages({key: value}, pb.PullResponse)
        yield from _snapshot_messages(shard.shard_id, self.server.reply(committed, whole=False))

    def _answer(self, answered: queue.SimpleQueue, worker: int, context):
        """The next (key, future) a pipelined push's reader gave, within the step timeout."""
        timeout = self._timeout(context)
        try:
            item = answered.get(timeout=timeout)
        except queue.Empty:
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                (
                    f"push of worker {worker} to server {self.server.shard_id}: a piece was not applied after "
                    f"{timeout:.1f} s (in sync mode every worker must push each step)"
                ),
            ) from None
        if isinstance(item, ValueError):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(item)) from item
        if isinstance(item, Exception):
            raise item
        return item

    def job_finish(self, request, context) -> Iterator[pb.PullResponse | bytes]:
        request = _parsed(request)
        shard = self._layout()
        coefficient = request.coefficient if request.HasField("coefficient") else None
        applied = self._applied(
            self.server.finish(request.worker, request.version, coefficient), request.worker, context
        )
        yield from _snapshot_messages(shard.shard_id, self.server.reply(applied))

    def job_optimizer_state(self, request, context) -> pb.PlainData:
        _parsed(request)
        self._layout()
        return pb.PlainData(data=to_bytes(self.server.optimizer_state()))

    def job_load_optimizer_state(self, request, context) -> pb.PlainData:
        request = _parsed(request)
        self._layout()
        try:
            state, groups = from_bytes(request.data, "JobLoadOptimizerState's data")
            self.server.load_optimizer_state(state, groups)
        except (ValueError, KeyError, TypeError) as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"JobLoadOptimizerState: {e}") from e
        return pb.PlainData()

    def job_load_values(self, request, context) -> pb.PlainData:
        request = _parsed(request)
        self._layout()
        try:
            self.server.load_values(*from_bytes(request.data, "JobLoadValues' data"))
        except (ValueError, KeyError, TypeError) as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"JobLoadValues: {e}") from e
        return pb.PlainData()

    def job_checkpoint(self, request, context) -> pb.PlainData:
        request = _parsed(request)
        self._layout()
        directory, base = from_bytes(request.data, "JobCheckpoint's folders")
        return pb.PlainData(data=to_bytes(self.server.checkpoint(directory, base)))

    def job_probe(self, request, context) -> pb.PlainData:
        """Nothing back: the worker times the request's bytes (`GrpcTransport.bandwidth`); no model needed."""
        _parsed(request)
        return pb.PlainData()

    def _timeout(self, context) -> float:
        """The step timeout, or less when the call's deadline comes first."""
        remaining = context.time_remaining()
        return self.step_timeout if remaining is None else min(self.step_timeout, remaining)

    def _applied(self, fut, worker: int, context):
        """Wait (within the step timeout and the call's deadline) until the push `fut` is applied; the
        `Committed` it resolved to."""
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        start = time.monotonic()
        if not done.wait(self._timeout(context)):
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"push of worker {worker} to server {self.server.shard_id}: not applied after "
                f"{time.monotonic() - start:.1f} s (in sync mode every worker must push each step)",
            )
        return self._value(fut)

    @staticmethod
    def _value(fut):
        """What a done future of the server resolved to; its GradientError as INVALID_ARGUMENT, any other error
        (the server's answer: a step that cannot be taken, a worker gone) as ABORTED."""
        try:
            return fut.value()
        except GradientError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        except Exception as e:
            raise Refused(grpc.StatusCode.ABORTED, str(e)) from e

    def checkpoint(self, request, context) -> pb.CheckpointResponse:
        _parsed(request)
        shard = self._layout()
        if self.checkpoint_dir is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"server {shard.shard_id} has no checkpoint directory: pass checkpoint_dir to serve_grpc",
            )
        path, version = self.server.checkpoint(self.checkpoint_dir)
        return pb.CheckpointResponse(path=path, version=version)


def _header(request_iterator, kind: str, header_kind: str):
    """The header that must open a push stream."""
    first = next(request_iterator, None)
    first = _parsed(_Malformed(kind, "the stream is empty") if first is None else first)
    if isinstance(first, tensor_codec.Chunk) or first.WhichOneof("item") != "header":
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{kind}: the first message must be a {header_kind}")
    return first.header


def _job_tensors(shard: ShardLayout, request_iterator) -> Iterator[tuple[tensor_codec.Key, torch.Tensor]]:
    """The tensors of a JobPush stream after its header, each as soon as it is complete: at most the shard's
    buckets plus its buffers, and the shard's bytes; a bucket index must be the shard's.

    Raises:
        ValueError: naming the message, the tensor and the field or limit.
    """
    buckets = shard.buckets
    for key, tensor in tensor_codec.decode_each(
        _chunks(request_iterator, "JobPushRequest"), max_bytes=shard.nbytes, max_tensors=buckets + len(shard.buffers)
    ):
        if isinstance(key, int) and key >= buckets:
            raise ValueError(
                f"JobPushRequest: Tensor.bucket {key} is not a bucket of server {shard.shard_id}, which "
                f"owns {buckets} (indices 0..{buckets - 1} in its bucket order): do both ends hold the same plan?"
            )
        yield key, tensor


def _chunks(request_iterator, kind: str) -> Iterator[pb.Tensor | tensor_codec.Chunk]:
    for message in request_iterator:
        if isinstance(message, tensor_codec.Chunk):
            yield message
            continue
        if isinstance(message, _Malformed):
            raise ValueError(message.message)
        if message.WhichOneof("item") != "chunk":
            raise ValueError(f"{kind}: only the first message may be a header; later ones must be chunks")
        yield message.chunk


def _snapshot_messages(shard_id: int, snapshot: Snapshot | Partial) -> Iterator[pb.PullResponse | bytes]:
    """A `Snapshot` as the job calls send it: a PullHeader, the buckets by index, the buffers by name; a held
    step's `Partial`: a PullHeader alone."""
    if isinstance(snapshot, Partial):
        yield pb.PullResponse(header=pb.PullHeader(shard_id=shard_id, version=snapshot.version, partial=snapshot.value))
        return
    yield pb.PullResponse(header=pb.PullHeader(shard_id=shard_id, version=snapshot.version))
    tensors: dict[tensor_codec.Key, torch.Tensor] = dict(enumerate(snapshot.flats))
    tensors.update(snapshot.buffers)
    yield from tensor_codec.encode_messages(tensors, pb.PullResponse)
