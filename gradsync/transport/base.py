"""The two sides every transport implements: a worker's calls to the servers, and its part in a rank's life.

`WorkerTransport` is what a ps or hybrid worker calls (one call reaches every server and waits, bounded by
the job's timeouts, for all of them); `RankTransport` is what `gradsync.runtime` calls as a rank starts,
serves and leaves. Each transport declares its `Capabilities` (`gradsync.core.transport_capabilities`);
what it lacks is refused from there, before a job or a Trainer starts. `gradsync.transport.registry` finds
both sides by the `transport` setting's value.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.buckets import Bucket, ModelSpec
from gradsync.core.transport_capabilities import Capabilities
from gradsync.metrics.timeline import Timeline
from gradsync.ps.messages import Partial, Piece, PipelineHead, Push, Readmitted, Rejoined, Setup, Snapshot, TableCall
from gradsync.ps.replica import ReplicaLink, ShardCopy
from gradsync.ps.server import ParameterServer

PROBE_BYTES = 2**20
"""The first large probe message of `link_rate`: 80 ms behind 100 Mbit/s, under a millisecond on loopback."""
PROBE_S = 0.02
"""How long the large probe message must take for `link_rate` to trust its time."""


def link_rate(servers: int, timed, largest: int = 64 * PROBE_BYTES) -> float:
    """The slowest server's bytes/s: `timed(server, nbytes)` (a message of `nbytes` there and its answer, in
    seconds) for a small and a large message, the best of two each, the large one growing from `PROBE_BYTES`
    (x8, up to `largest`) until it takes `PROBE_S`; (large - small) bytes / (their time difference)."""
    rates = []
    for s in range(servers):
        nbytes = PROBE_BYTES
        while True:
            small, large = (min(timed(s, n) for _ in range(2)) for n in (1024, nbytes))
            if large >= PROBE_S or nbytes * 8 > largest:
                break
            nbytes *= 8
        rates.append((nbytes - 1024) / max(large - small, 1e-6))
    return min(rates)


IN_FLIGHT_MB = 0.25
"""A worker's unanswered pieces per server, in MB per worker of the job (so 0.5 MB at W = 2, 1 MB at W = 4;
at least two pieces): a worker ahead of the others waits for their parts of its oldest piece, which keeps W
workers' pushes into one server link in step, as BytePS's credits do, and a link's queue short. A fixed window
per server left a server link idle at W = 4 and overflowed its queue at W = 2 when larger: per worker of the job
is what measured best at every W (bench/linkfloor.py; BENCHMARKS.md, "The window of unanswered pieces"). Both
transports keep it (`window`)."""


def window(server_buckets: dict[int, list[Bucket]], workers: int, early: bool = True) -> int:
    """How many pieces a worker keeps unanswered per server: `IN_FLIGHT_MB` x `workers` of the largest, at
    least two; all of them when a piece is answered only at its step's end (not `early`: `core.buckets.applied_early`),
    since the oldest one's answer waits for the last."""
    if not early:
        return max((len(per) for per in server_buckets.values()), default=1)
    largest = max((b.nbytes for per in server_buckets.values() for b in per), default=1)
    return max(2, math.ceil(IN_FLIGHT_MB * workers * 2**20 / largest))


class StepPipeline(Protocol):
    """A sync step's pieces on their way to the servers, some of which leave during the backward
    (`worker.pipeline.streaming`): what `WorkerTransport.pipeline` returns where the transport `streams`."""

    def room(self, server: int) -> bool:
        """Whether a piece for `server` may leave now, without waiting."""
        ...

    def send(self, piece: Piece) -> None:
        """Send `piece` now."""
        ...

    def finish(self, heads: dict[int, PipelineHead], pieces: list[Piece]) -> dict[int, Snapshot]:
        """Send each server's head and the other `pieces`, wait for every reply; each server's snapshot."""
        ...


class WorkerTransport(ABC):
    """A worker's calls to every server; each waits (bounded by the job's timeouts) for all servers."""

    capabilities: ClassVar[Capabilities]

    def __init__(
        self,
        config: JobConfig,
        store: dist.Store,
        server_buckets: dict[int, list[Bucket]],
        timeline: Timeline | None = None,
        early: bool = True,
    ):
        """Args: the job, its rendezvous store, each server's buckets of the shared plan (by server), where
        `push_pieces` records its lanes' events (the worker's `StepMetrics.timeline`, on when GRADSYNC_TIMELINE
        is; None: nowhere), and whether the servers answer a piece as soon as its bucket is applied (`window`)."""
        self.timeline = Timeline(on=False) if timeline is None else timeline
        self.config = config
        self.store = store
        self.worker = config.worker_rank
        self.servers = list(server_buckets)
        self.server_buckets = server_buckets
        self.window = window(server_buckets, config.num_workers, early)  # pieces unanswered per server

    @classmethod
    def bandwidth(cls, config: JobConfig, store: dist.Store) -> float | None:
        """The bytes/s this worker reaches the slowest server at, measured now (before any plan: the piece
        size is chosen from it, `worker.pipeline.piece_size`, with `link_rate`); None when this transport does not
        measure it."""
        return None

    @abstractmethod
    def register(self, spec: ModelSpec, setups: dict[int, Setup | None]) -> dict[str, torch.Tensor]:
        """Register this worker's model on every server (worker 0 brings each server's setup); returns the
        frozen parameters' values (worker 0's)."""

    @abstractmethod
    def pull(self) -> dict[int, Snapshot]:
        """Every server's current snapshot."""

    @abstractmethod
    def push(self, versions: dict[int, int], pushes: dict[int, Push]) -> dict[int, Snapshot | Partial]:
        """One step: per server named in `pushes`, the version it was pulled at and its `Push`; returns each one's
        snapshot after the step (with `Push.agree`, its `Partial` of the held step's norm, and `finish` applies it)."""

    @abstractmethod
    def push_pieces(
        self, versions: dict[int, int], heads: dict[int, PipelineHead], pieces: list[Piece]
    ) -> dict[int, Snapshot]:
        """A sync step as pieces: per server a `Push` without gradients (`heads`), then the `Piece`s in the
        forward's order; returns each server's snapshot after the step."""

    @abstractmethod
    def finish(self, versions: dict[int, int], coefficient: float | None) -> dict[int, Snapshot]:
        """Apply the held step of each server named in `versions` with its gradients times `coefficient` (None:
        skip it); returns each one's snapshot after it (`SyncRule.finish`)."""

    @abstractmethod
    def optimizer_state(self) -> dict[int, dict]:
        """Every server's optimizer state by entry key and its groups' options."""

    @abstractmethod
    def load_optimizer_state(self, parts: dict[int, tuple[dict, list]]) -> None:
        """Give every server its (state by entry key, group options)."""

    @abstractmethod
    def load_values(self, number: int, parts: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]]) -> None:
        """Give every server its values of a worker's `model.load_state_dict(...)`, the load's `number`:
        (bucket tensors, buffers, frozen parameters and table rows by name) (`ParameterServer.load_values`)."""

    @abstractmethod
    def state(self) -> dict[int, tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]]:
        """Every server's (version, bucket tensors, buffers and frozen parameters by name)."""

    @abstractmethod
    def stats(self) -> dict[int, dict]:
        """Every server's counters."""

    @abstractmethod
    def checkpoint(self, directory: str, base: str | None = None) -> dict[int, tuple[str, int]]:
        """Every server writes its shard into `directory` (on its machine): (path, version) by server; with
        `base`, the folder of their last full checkpoint, their dynamic tables as a delta onto it."""

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds (connections); the job's shutdown stops the servers."""

    def pull_rows_many(
        self, lookups: list[tuple[str, dict[int, torch.Tensor]]], before: frozenset[int] = frozenset()
    ) -> list[dict[int, tuple[int, torch.Tensor]]]:
        """Rows of embedding tables for a forward's waiting lookups, each (table, its unique local row ids per
        server); returns for each lookup, in order, per server (version, rows); from the servers in `before`, the
        rows as their last closed step began (a dead worker's replacement redoing it). A transport with
        `capabilities.row_tables` implements it."""
        raise NotImplementedError(self.capabilities.rows_refusal())

    def table_calls(self, calls: Mapping[int, TableCall]) -> dict[int, Any]:
        """A call on the dynamic tables of each server named (`ParameterServer.table_call`); returns each one's
        answer. A transport with `capabilities.row_tables` implements it."""
        raise NotImplementedError(self.capabilities.rows_refusal())

    def table_rows(self, table: str) -> dict[int, torch.Tensor]:
        """Every server's rows of embedding table `table`, in local order. A transport with
        `capabilities.row_tables` implements it."""
        raise NotImplementedError(self.capabilities.rows_refusal())

    def rejoin(self, spec: ModelSpec) -> dict[int, Rejoined]:
        """Rejoin every server as the replacement of this worker, which died (`ParameterServer.rejoin`); returns
        each server's answer. A transport with `capabilities.replaces_workers` implements it."""
        raise NotImplementedError(self.capabilities.replacement_refusal(self.capabilities.name))

    def readmit(self, spec: ModelSpec, number: int, step: int) -> dict[int, Readmitted]:
        """Ask every server to take this worker's `number`-th replacement into the steps from `step` on
        (`ParameterServer.readmit`: worker_loss drop); returns each server's answer. A transport with
        `capabilities.replaces_workers` implements it."""
        raise NotImplementedError(self.capabilities.replacement_refusal(self.capabilities.name))

    def pipeline(self, versions: dict[int, int]) -> StepPipeline:
        """A sync step's pieces, some of which may leave before the step (during the backward:
        `worker.pipeline.streaming`), pulled at `versions`. A transport with `capabilities.streams` implements it."""
        raise NotImplementedError(f"{type(self).__name__} sends no piece of a step during the backward")


class RankTransport(ABC):
    """A transport's part in a rank's life: on a server, taking calls (`install`, `serve`); on every rank,
    starting (`start`) and leaving (`leave`)."""

    def install(self, server: ParameterServer) -> None:
        """Make `server` the target of this process's incoming calls of its shard (with replicas a server installs
        its own shard's and the one it keeps a replica of); a server calls it before `start`, so that no call
        arrives first."""

    def replica_link(self, shard: int, to: str | None, config: JobConfig, store: dist.Store) -> ReplicaLink:
        """Where shard `shard`'s closed steps go: its replica on the server of RPC name `to` (None: none yet), in a
        job with replicas (`ps.replica`); only torch RPC keeps replicas (`JobConfig` refuses the others)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no replica of a shard")

    def copy_shard(self, shard: int, primary: str, me: str, timeout: float) -> ShardCopy:
        """A dead server's replacement (RPC name `me`): shard `shard` as its primary (RPC name `primary`) holds
        it now."""
        raise NotImplementedError(f"{type(self).__name__} keeps no replica of a shard")

    def keep_shard(self, shard: int, primary: str, me: str, timeout: float) -> None:
        """A dead server's replacement (RPC name `me`): tell `shard`'s primary that its replica is built."""
        raise NotImplementedError(f"{type(self).__name__} keeps no replica of a shard")

    @abstractmethod
    def start(self, config: JobConfig, store: dist.Store) -> None:
        """Start this rank's side of the transport (every rank, and a worker that joins a running job)."""

    def serve(self, server: ParameterServer, store: dist.Store, config: JobConfig) -> None:
        """On a server whose gRPC endpoint is up: whatever the transport needs before the workers' first
        calls (nothing by default)."""

    @abstractmethod
    def leave(self, config: JobConfig, store: dist.Store, timeout: float, at_once: bool = False) -> None:
        """Stop this rank's side: gracefully within `timeout` seconds, or, with `at_once` (some rank is not
        leaving), without waiting for the others."""
