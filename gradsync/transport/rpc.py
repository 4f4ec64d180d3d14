"""torch RPC (TensorPipe): the default transport of the ps strategy, both sides, and the RPC start-up.

Worker side: `RpcTransport`, one asynchronous RPC per server per call. Rank
side: `RpcRank` starts and stops RPC on every rank; on a server the module-level
`rpc_*` handlers (torch RPC pickles functions by module path) call the process's
`ParameterServer` of the shard the call names, installed before RPC starts (with
replicas, a server holds its own shard and the replica of the one before). A
step is one RPC per server: the push carries the gradients and its reply the
next version's snapshot, which the worker's next forward uses without a pull.
With replicas, a call whose server died goes again to the shard's replica once the
launcher says it serves the shard (`membership.lost_servers`).

TensorPipe is started with the `uv` transport only: the shared-memory
transport's reactor thread busy-polls a whole core whenever the process waits.
In a job on an emulated network (`gradsync.launcher.netem`) tensors go through that
transport too (the `basic` channel): the default `cma` channel copies them
between the processes' memory directly, around the rate-limited links.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler

from gradsync.config import JobConfig
from gradsync.core import settings
from gradsync.core.buckets import ModelSpec
from gradsync.core.errors import Refusal
from gradsync.core.futures import failed, resolved
from gradsync.core.job_names import StoreKeys, server_name
from gradsync.core.torch_internals import RPC_TIMEOUT_TEXT, set_rpc_timeout
from gradsync.core.transport_capabilities import capabilities
from gradsync.core.waiting import POLL_S
from gradsync.membership.lost_servers import dead, primary, replica_server
from gradsync.metrics.timeline import HEAD
from gradsync.ps.messages import (
    Committed,
    Partial,
    Piece,
    PipelineHead,
    Push,
    Readmitted,
    Rejoined,
    Setup,
    Snapshot,
    TableCall,
)
from gradsync.ps.replica import ReplicaLink, ShardCopy, StepRecord
from gradsync.ps.server import ParameterServer
from gradsync.transport import rpc_group
from gradsync.transport.base import RankTransport, WorkerTransport, link_rate

_RPC_THREADS = 16
"""Each rank's pool of RPC threads at least: torch's default."""
_RPC_THREADS_PER_RANK = 4
"""And 4 per rank of the job: a server decodes and applies the pieces of every worker on them, each worker
keeping a window of pieces in flight, so the pool grows with the job rather than queue its pieces behind
one another."""


def start_rpc(config: JobConfig, store: dist.Store) -> None:
    """Join the job's RPC world through the rendezvous store (a dynamic group in elastic jobs and those whose dead
    workers are replaced: `rpc_group`).
    Every rank must call it."""
    # Store.clone: missing from torch's stubs
    prefixed = dist.PrefixStore(StoreKeys.RPC, store.clone() if config.dynamic_group else store)  # type: ignore[attr-defined]
    name, rank = config.rpc_identity

    def handler(url, **kwargs):
        yield prefixed, rank, config.world_size

    register_rendezvous_handler("gradsync", handler)
    # rpc.init_rpc's own all_gather_object trips a deprecation warning inside torch; it is not ours to fix
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    channels: dict[str, Any] = {"_channels": ["basic"]} if settings.LINK.read() else {}
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="gradsync://",
        rpc_timeout=config.startup_timeout,
        num_worker_threads=max(_RPC_THREADS, _RPC_THREADS_PER_RANK * config.world_size),
        _transports=["uv"],
        **channels,
    )
    if config.dynamic_group:
        rpc_group.join(config, store, lambda: rpc.init_rpc(name, rank=rank, rpc_backend_options=options))
    else:
        rpc.init_rpc(config.name, rank=config.rank, world_size=config.world_size, rpc_backend_options=options)
    set_rpc_timeout(config.call_timeout)


def stop_rpc(timeout: float | None) -> None:
    """Leave the RPC world: gracefully within `timeout` seconds when every rank is leaving too, else (or with
    None) at once."""
    if timeout is None:
        rpc.shutdown(graceful=False)
        return
    try:
        rpc.shutdown(graceful=True, timeout=timeout / 2)  # torch waits that long twice: for the others, for itself
    except RuntimeError:  # a rank left without waiting, or is late; torch has shut this agent down all the same
        pass


_Key = TypeVar("_Key", int, tuple[int, int])


Again = Callable[[int, BaseException], "torch.futures.Future | None"]
"""The call to server `s` sent again, elsewhere, after `error` (its server died), or None: the error stands."""


def wait_all(
    futures: Mapping[_Key, torch.futures.Future], what: str, timeout: float, again: Again | None = None
) -> dict[_Key, Any]:
    """Wait for one future per server (or per (server, ...) key); the error names the operation, server and
    elapsed time. The values are what the servers' handlers returned. `again`: what sends a server's call again
    when it failed on its way (not a handler's answer: `RpcTransport._again`)."""
    start = time.monotonic()
    results: dict[_Key, Any] = {}
    error: BaseException
    for server, fut in futures.items():
        try:
            result = fut.wait()
        except Exception as e:
            error = e
            resent = again(server, e) if again is not None and isinstance(server, int) else None
            if resent is not None:
                results.update(wait_all({server: resent}, what, timeout, again))
                continue
        else:
            # a handler's error comes back as a value (`_answering`; torch RPC hands an exception set on an
            # async_execution future back as one too)
            if not isinstance(result, BaseException):
                results[server] = result
                continue
            error = result
        elapsed = time.monotonic() - start
        peer = server_name(server) if isinstance(server, int) else f"{server_name(server[0])} ({server[1:]})"
        raise _kind(error)(
            f"{what} on {peer} failed after {elapsed:.1f} s (timeout {timeout:.0f} s): {error}"
        ) from error
    return results


def _kind(error: BaseException) -> type[Exception]:
    """The exception a failed call raises, the type the gRPC transport raises for the same failure: TimeoutError
    past the call's timeout, ValueError for a call the server refused (`Refusal`), else RuntimeError."""
    if isinstance(error, Refusal):
        return ValueError
    return TimeoutError if RPC_TIMEOUT_TEXT in str(error) else RuntimeError


def _timed(server: int, nbytes: int, timeout: float) -> float:
    """The time of a message of `nbytes` to `server` and its answer."""
    payload, start = torch.zeros(nbytes // 4), time.perf_counter()
    rpc.rpc_sync(server_name(server), rpc_probe, args=(payload,), timeout=timeout)
    return time.perf_counter() - start


class RpcTransport(WorkerTransport):
    """The worker side: one asynchronous torch RPC per server for each call."""

    capabilities = capabilities("rpc")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the RPC name of each shard's server now (`_again`), where a replacement starts too
        self.homes = {s: primary(self.store, s) if self.config.replicated else server_name(s) for s in self.servers}
        self.done = dict.fromkeys(self.servers, 0)  # replicas: the steps each shard answered this worker closed
        self._held: dict[int, tuple[int, Push]] = {}  # replicas: each shard's push of the held step (`finish`)

    def _send(self, s: int, fn, args: tuple, timeout: float) -> torch.futures.Future:
        """`fn(s, *args)` on the server that serves shard `s` now."""
        return rpc.rpc_async(self.homes[s], fn, args=(s, *args), timeout=timeout)

    def _call(self, fn, args_of, what: str, timeout: float | None = None, servers=None, first=None) -> dict[int, Any]:
        """`fn(s, *args_of(s))` on every server (or those of `servers`), waited for; `first(s)`: what is sent
        again before it when its server died (`_again`)."""
        timeout = timeout or self.config.call_timeout
        futures = {s: self._send(s, fn, args_of(s), timeout) for s in (self.servers if servers is None else servers)}
        return wait_all(futures, what, timeout, self._again(fn, args_of, timeout, first))

    def _again(self, fn, args_of, timeout: float, first=None) -> Again | None:
        """With replicas: what sends a call whose server died again, to the shard's replica, once the launcher
        says it serves the shard (within step_timeout), after `first(s)` when given; None without replicas."""
        if not self.config.replicated:
            return None

        def again(s: int, error: BaseException) -> torch.futures.Future | None:
            if not dead(self.store, self.homes[s], self.config.step_timeout):
                return None
            self.homes[s] = primary(self.store, s)
            if first is not None:
                first(s)
            return self._send(s, fn, args_of(s), timeout)

        return again

    def _done(self, s: int) -> int | None:
        return self.done[s] if self.config.replicated else None

    def _answered(self, replies: Mapping[int, Any]) -> None:
        """Count the steps these replies closed, per shard (replicas: `ps.replica`)."""
        for s, reply in replies.items():
            if not isinstance(reply, Partial):
                self.done[s] += 1

    @classmethod
    def bandwidth(cls, config: JobConfig, store: dist.Store) -> float:
        """`link_rate` by torch RPC messages (`rpc_probe`)."""
        return link_rate(config.servers, lambda s, n: _timed(s, n, config.startup_timeout))

    def register(self, spec: ModelSpec, setups: dict[int, Setup | None]) -> dict[str, torch.Tensor]:
        """With replicas, on each shard's replica too, which builds the same shard."""
        timeout, frozen = self.config.startup_timeout, {}
        futures: dict[Any, torch.futures.Future] = {
            s: self._send(s, rpc_register, (self.worker, spec, setups[s]), timeout) for s in self.servers
        }
        if self.config.replicated:
            for s in self.servers:
                to = replica_server(s, self.config.servers)
                futures[(to, f"replica of shard {s}")] = rpc.rpc_async(
                    server_name(to), rpc_register, args=(s, self.worker, spec, setups[s]), timeout=timeout
                )
        for part in wait_all(futures, "registering the model", timeout).values():
            frozen.update(part)
        return frozen

    def rejoin(self, spec: ModelSpec) -> dict[int, Rejoined]:
        """With replicas, the steps each shard took of this worker count as answered (`ps.replica`)."""
        answers = self._call(
            rpc_rejoin, lambda s: (self.worker, spec), "rejoining the job", self.config.startup_timeout
        )
        for s, answer in answers.items():
            if answer.taken is not None:
                self.done[s] = answer.taken
        return answers

    def readmit(self, spec: ModelSpec, number: int, step: int) -> dict[int, Readmitted]:
        return self._call(
            rpc_readmit,
            lambda s: (self.worker, spec, number, step),
            "joining the job again",
            self.config.startup_timeout,
        )

    def pull(self) -> dict[int, Snapshot]:
        return self._call(rpc_pull, lambda s: (), "pull")

    def pull_rows_many(
        self, lookups: list[tuple[str, dict[int, torch.Tensor]]], before: frozenset[int] = frozenset()
    ) -> list[dict[int, tuple[int, torch.Tensor]]]:
        """One call per server for every lookup it holds rows of."""
        asked: dict[int, list[tuple[int, str, torch.Tensor]]] = {}
        for i, (table, ids) in enumerate(lookups):
            for s, local in ids.items():
                asked.setdefault(s, []).append((i, table, local))
        tables = ", ".join(repr(t) for t in dict.fromkeys(t for t, _ in lookups))
        answers = self._call(
            rpc_pull_rows_many,
            lambda s: ([(t, ids) for _, t, ids in asked[s]], s in before),
            f"pulling rows of tables {tables}",
            servers=asked,
        )
        out: list[dict[int, tuple[int, torch.Tensor]]] = [{} for _ in lookups]
        for s, items in asked.items():
            for (i, _, _), answer in zip(items, answers[s]):
                out[i][s] = answer
        return out

    def push(self, versions: dict[int, int], pushes: dict[int, Push]) -> dict[int, Snapshot | Partial]:
        replies = self._call(
            rpc_push, lambda s: (self.worker, versions[s], pushes[s], self._done(s)), "push", servers=pushes
        )
        if self.config.replicated:
            self._answered(replies)
            self._held = {s: (versions[s], pushes[s]) for s, reply in replies.items() if isinstance(reply, Partial)}
        return replies

    def push_pieces(
        self, versions: dict[int, int], heads: dict[int, PipelineHead], pieces: list[Piece]
    ) -> dict[int, Snapshot]:
        """A sync step as a pipeline: a push per server that carries no gradient (`heads`: payloads None),
        then one call per piece, in the order given, each answered with the bucket's values as soon as its
        server has applied it. Returns each server's snapshot after the step."""
        return self.pipeline(versions).finish(heads, pieces)

    def pipeline(self, versions: dict[int, int]) -> Pipeline:
        """A sync step's pieces, some of which may leave before the step (during the backward:
        `worker.pipeline.streaming`)."""
        return Pipeline(self, versions)

    def finish(self, versions: dict[int, int], coefficient: float | None) -> dict[int, Snapshot]:
        """Apply (or, with None, skip) the held step on every server: see `SyncRule.finish`. With replicas, a
        replica that serves a shard whose server died is sent the held push again first, which it may not hold."""

        def push_again(s: int) -> None:
            version, push = self._held[s]
            args = (self.worker, version, push, self._done(s))
            wait_all({s: self._send(s, rpc_push, args, self.config.call_timeout)}, "push", self.config.call_timeout)

        replies = self._call(
            rpc_finish,
            lambda s: (self.worker, versions[s], coefficient, self._done(s)),
            "finishing the step",
            servers=versions,
            first=push_again,
        )
        if self.config.replicated:
            self._answered(replies)
        return replies

    def optimizer_state(self) -> dict[int, dict]:
        return self._call(rpc_optimizer_state, lambda s: (), "reading the optimizer state")

    def load_optimizer_state(self, parts: dict[int, tuple[dict, list]]) -> None:
        self._call(rpc_load_optimizer_state, lambda s: parts[s], "loading the optimizer state")

    def load_values(self, number: int, parts: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]]) -> None:
        self._call(rpc_load_values, lambda s: (number, *parts[s]), "loading the model's values")

    def state(self) -> dict[int, tuple]:
        return self._call(rpc_state, lambda s: (), "state")

    def table_calls(self, calls: Mapping[int, TableCall]) -> dict[int, Any]:
        what = ", ".join(sorted({type(c).__name__ for c in calls.values()}))
        return self._call(rpc_table_call, lambda s: (calls[s],), f"{what} on dynamic tables", servers=calls)

    def table_rows(self, table: str) -> dict[int, torch.Tensor]:
        return self._call(rpc_table_rows, lambda s: (table,), f"reading table {table!r}")

    def stats(self) -> dict[int, dict]:
        return self._call(rpc_stats, lambda s: (), "stats")

    def checkpoint(self, directory: str, base: str | None = None) -> dict[int, tuple[str, int]]:
        return self._call(rpc_checkpoint, lambda s: (directory, base), "checkpoint")

    def close(self) -> None:
        """Nothing to release: RPC stops with the job."""


class Pipeline:
    """One sync step's pieces on their way to the servers, at most a window of them unanswered per server (a
    worker ahead of the others waits for their parts of its oldest piece, which keeps W workers' pushes into
    one server link in step, as BytePS's credits do). During the backward a piece leaves when `room` says
    its server's window has some (`worker.pipeline.streaming` never waits); `finish` sends the step's heads and the
    rest, and waits."""

    def __init__(self, transport: RpcTransport, versions: dict[int, int]):
        self.transport = transport
        self.versions = versions
        self.timeout = transport.config.call_timeout
        self.futures: dict[tuple[int, int], torch.futures.Future] = {}  # the last piece sent of each bucket
        self.flying: dict[int, list[torch.futures.Future]] = {s: [] for s in transport.servers}

    def room(self, server: int) -> bool:
        """Whether a piece for `server` may leave now, without waiting."""
        flying = self.flying[server]
        flying[:] = [f for f in flying if not f.done()]
        return len(flying) < self.transport.window

    def send(self, piece: Piece) -> None:
        """Send `piece` now (call `room` first: the window is the caller's to keep)."""
        t = self.transport
        s, b = piece.server, piece.bucket
        self.futures[(s, b)] = fut = t.timeline.timed(
            (s, b), t._send, s, rpc_push_piece, (t.worker, self.versions[s], piece, t.timeline.on), self.timeout
        )
        self.flying[s].append(fut)

    def finish(self, heads: dict[int, PipelineHead], pieces: list[Piece]) -> dict[int, Snapshot]:
        """Send each server's head (`Push` with payloads None), then `pieces` in the order given, and wait for
        every piece's reply (sync: the bucket's values once its server applied it) and every head's; returns
        each server's snapshot after the step (async, ssp: the head's reply brings it whole)."""
        t = self.transport
        replies = {
            s: t.timeline.timed((s, HEAD), t._send, s, rpc_push, (t.worker, self.versions[s], heads[s]), self.timeout)
            for s in t.servers
        }
        for piece in pieces:
            flying = self.flying[piece.server]
            if len(flying) >= self.transport.window:
                wait_all({piece.server: flying.pop(0)}, "pushing a piece (bucket)", self.timeout)
            self.send(piece)
        values = wait_all(self.futures, "pushing a piece (bucket)", self.timeout)
        flats = {s: [values[(s, b)] for b in sorted(b for t, b in values if t == s)] for s in t.servers}
        return {
            s: snap if snap.flats else snap._replace(flats=flats[s])
            for s, snap in wait_all(replies, "push", self.timeout).items()
        }


class RpcReplicaLink:
    """A shard's closed steps to its replica's server, each answered once the replica holds it (`ps.replica`).
    A stopped server answers nothing: the launcher's word that it died ends the wait, and the shard goes on
    without a replica. Every call comes with the shard's lock held."""

    def __init__(self, shard: int, to: str | None, config: JobConfig, store: dist.Store):
        self.shard, self.to, self.config, self.store = shard, to, config, store
        self.held: list[StepRecord] | None = None  # the records kept while a replica is built (`hold`)
        self.holder: str | None = None  # the server that builds it

    def send(self, record: StepRecord) -> None:
        if self.held is not None and self.holder is not None and dead(self.store, self.holder):
            self.held = self.holder = None  # it died building the replica: none
        if self.held is not None:
            self.held.append(record)
        elif self.to is not None:
            to, timeout = self.to, self.config.call_timeout
            call = rpc.rpc_async(to, rpc_replicate, args=(self.shard, record), timeout=timeout)
            answered = threading.Event()
            call.add_done_callback(lambda _: answered.set())
            while not answered.wait(POLL_S):
                if dead(self.store, to):
                    self.to = None
                    return
            wait_all({0: call}, f"keeping the replica of shard {self.shard} on {to}", timeout, self._gone)

    def _gone(self, _: int, error: BaseException) -> torch.futures.Future | None:
        """After a failed send: nothing more to send, once the launcher says the replica's server died."""
        if self.to is None or not dead(self.store, self.to, self.config.step_timeout):
            return None
        self.to = None
        return resolved(None)

    def hold(self, name: str) -> None:
        self.held, self.holder = [], name

    def release(self, name: str) -> None:
        held, self.held, self.holder, self.to = self.held or [], None, None, name
        for record in held:
            self.send(record)


def _answer(value):
    """A handler's answer, raised when it is an error (`_answering`)."""
    if isinstance(value, BaseException):
        raise _kind(value)(str(value)) from value
    return value


class RpcRank(RankTransport):
    """Every rank joins the RPC world; a server's handlers call its `ParameterServer`s."""

    def install(self, server: ParameterServer) -> None:
        _SERVERS[server.shard_id] = server

    def replica_link(self, shard: int, to: str | None, config: JobConfig, store: dist.Store) -> ReplicaLink:
        return RpcReplicaLink(shard, to, config, store)

    def copy_shard(self, shard: int, primary: str, me: str, timeout: float) -> ShardCopy:
        """Shard `shard` as its primary (RPC name `primary`) holds it now, for this server (RPC name `me`); the
        steps after it are kept there."""
        return _answer(rpc.rpc_sync(primary, rpc_copy, args=(shard, me), timeout=timeout))

    def keep_shard(self, shard: int, primary: str, me: str, timeout: float) -> None:
        """Tell `shard`'s primary that this server (RPC name `me`) has built its replica from its copy."""
        _answer(rpc.rpc_sync(primary, rpc_keep, args=(shard, me), timeout=timeout))

    def start(self, config: JobConfig, store: dist.Store) -> None:
        start_rpc(config, store)

    def leave(self, config: JobConfig, store: dist.Store, timeout: float, at_once: bool = False) -> None:
        """An elastic job's rank leaves its dynamic group once its own calls are answered (`rpc_group.leave`);
        any other rank stops RPC gracefully, which needs every rank, or with `at_once` without waiting."""
        if config.dynamic_group:
            rpc_group.leave(config, store, timeout)
        else:
            stop_rpc(None if at_once else timeout)


_SERVERS: dict[int, ParameterServer] = {}  # by shard: the targets of this process's RPC handlers (`RpcRank.install`)


def _server(shard: int) -> ParameterServer:
    server = _SERVERS.get(shard)
    if server is None:
        raise RuntimeError(f"this process holds no shard {shard} of a gradsync parameter server")
    return server


def _answering(call: str, later: bool = False):
    """A server's handler of `call` whose exception is answered, not raised (torch RPC would print it raw on the
    server): `ParameterServer.fault` tells a refusal of what the call carries from the server's own failure, which
    it records before the caller sees it. `later`: an async_execution handler, answered with a failed future
    (which comes back to the caller as a value, as every handler's error does: `wait_all`). Every handler's
    first argument is the shard it calls; one whose second is `worker` names the caller."""

    def wrap(handler):
        names_worker = list(inspect.signature(handler).parameters)[1:2] == ["worker"]

        @functools.wraps(handler)
        def answer(shard: int, *args, **kwargs):
            try:
                return handler(shard, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- the caller is answered with it
                error = _server(shard).fault(e, call, args[0] if names_worker else None)
                return failed(error) if later else error

        return answer

    return wrap


@rpc.functions.async_execution
@_answering("registration", later=True)
def rpc_register(shard: int, worker: int, spec: ModelSpec, setup: Setup | None) -> torch.futures.Future:
    return _server(shard).register(worker, spec, setup)


@_answering("rejoin")
def rpc_rejoin(shard: int, worker: int, spec: ModelSpec) -> Rejoined:
    return _server(shard).rejoin(worker, spec)


@_answering("readmission")
def rpc_readmit(shard: int, worker: int, spec: ModelSpec, number: int, step: int) -> Readmitted:
    return _server(shard).readmit(worker, spec, number, step)


def rpc_probe(payload: torch.Tensor) -> int:
    """A message that only travels (`RpcTransport.bandwidth`); any rank answers it."""
    return payload.numel()


@_answering("pull")
def rpc_pull(shard: int) -> Snapshot:
    return _server(shard).pull()


@_answering("pull of rows")
def rpc_pull_rows_many(
    shard: int, lookups: list[tuple[str, torch.Tensor]], before: bool = False
) -> list[tuple[int, torch.Tensor]]:
    return [_server(shard).pull_rows(table, ids, before) for table, ids in lookups]


def _replied(
    server: ParameterServer, fut: torch.futures.Future, worker: int, call: str, whole: bool = True
) -> torch.futures.Future:
    def reply(committed: torch.futures.Future[Committed]) -> Snapshot | Partial:
        value = committed.value()  # raises the push's error, if any, into the reply
        try:
            return server.reply(value, whole)
        except Exception as e:
            raise server.fault(e, call, worker) from e

    return fut.then(reply)


@rpc.functions.async_execution
@_answering("push", later=True)
def rpc_push(shard: int, worker: int, pulled_version: int, push: Push, done: int | None = None) -> torch.futures.Future:
    server = _server(shard)
    whole = not isinstance(push, PipelineHead) or not server.pipelined  # async, ssp: pieces come back with the push
    return _replied(server, server.push(worker, pulled_version, push, done=done), worker, "push", whole=whole)


@rpc.functions.async_execution
@_answering("push of a piece", later=True)
def rpc_push_piece(
    shard: int, worker: int, pulled_version: int, piece: Piece, stamped: bool = False
) -> torch.futures.Future:
    """The bucket's values after the step; with `stamped`, its server events too (`metrics.timeline.Stamped`)."""
    return _server(shard).push_piece(worker, pulled_version, piece, stamped)


@rpc.functions.async_execution
@_answering("finish of a step", later=True)
def rpc_finish(
    shard: int, worker: int, version: int, coefficient: float | None, done: int | None = None
) -> torch.futures.Future:
    server = _server(shard)
    return _replied(server, server.finish(worker, version, coefficient, done), worker, "finish of a step")


@_answering("read of the optimizer state")
def rpc_optimizer_state(shard: int) -> dict:
    return _server(shard).optimizer_state()


@_answering("load of the optimizer state")
def rpc_load_optimizer_state(shard: int, state: dict, groups: list) -> None:
    _server(shard).load_optimizer_state(state, groups)


@_answering("load of the model's values")
def rpc_load_values(shard: int, number: int, flats: list, named: dict) -> None:
    _server(shard).load_values(number, flats, named)


@_answering("call on dynamic tables")
def rpc_table_call(shard: int, call: TableCall):
    return _server(shard).table_call(call)


@_answering("read of a table")
def rpc_table_rows(shard: int, table: str) -> torch.Tensor:
    return _server(shard).table_rows(table)


@_answering("read of the state")
def rpc_state(shard: int) -> tuple:
    return _server(shard).state()


@_answering("checkpoint")
def rpc_checkpoint(shard: int, directory: str, base: str | None) -> tuple[str, int]:
    return _server(shard).checkpoint(directory, base)


@_answering("read of the counters")
def rpc_stats(shard: int) -> dict:
    server = _server(shard)
    return {**server.stats(), "tables": server.table_stats()}


@_answering("replica of a step")
def rpc_replicate(shard: int, record: StepRecord) -> None:
    _server(shard).replicate(record)


@_answering("copy of a shard")
def rpc_copy(shard: int, name: str) -> ShardCopy:
    return _server(shard).copy_for(name)


@_answering("keeping of a replica")
def rpc_keep(shard: int, name: str) -> None:
    _server(shard).keep(name)
