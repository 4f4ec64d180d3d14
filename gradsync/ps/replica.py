"""A shard kept on a second server as well (replicas 1): the step record its primary sends, and its replay.

A shard's primary records, as its `ShardState` changes, every call that changes it (`StepJournal.record`:
group options, bucket gradients applied, the step's end with its buffers and rows, a skipped step, a loaded
module or optimizer state), and, once a step closes, before any worker hears of it, sends what the step
recorded (`StepRecord`) to the server that keeps the shard's replica. There the same calls run on a shard
built from the same setup (`replay`), in the same order, so the replica is the primary bit for bit. A step
counts as applied once both copies hold it: the replica answers a record as it arrives and replays it on a thread
of its own (`Replays`), in order, before it answers any call of its own; when the primary dies, the next server
serves the shard.

A dead server's replacement copies each shard left without a replica from its primary (`ShardCopy`: the shard's
state as a checkpoint holds it, and its counters), while the primary keeps the records of the steps after the copy
(`ReplicaLink.hold`), which it sends once the copy is built there (`ReplicaLink.release`); from then on the
replacement is that shard's replica.

Each copy counts the closed steps each worker took part in (`StepJournal.taken`), as the worker counts the
steps each server answered it (`RpcTransport.done`): a worker that sends a call again, to the replica, for a
step whose answer it lost is answered from the replica's state (`ParameterServer.push`), never counted twice.
"""

from __future__ import annotations

import copy
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from gradsync.ps.messages import Partial, Setup


class StepRecord(NamedTuple):
    """What a closed step (or a load) changed on a shard, as its primary's calls did it."""

    entries: list[tuple]  # (call name, arguments), in order: `replay`
    workers: tuple[int, ...]  # the workers whose pushes the step took (none: a load)
    partial: Partial | None  # its norm's part, when it was held for the workers' word
    stats: Any  # the primary's `ShardStats` after it; None: a load


class ShardCopy(NamedTuple):
    """A shard as its primary holds it, for a server that builds its replica anew."""

    setup: Setup  # what builds a shard of its layout (values to be replaced by `state`'s)
    state: dict  # `ps.shard_file.captured`
    stats: Any  # its `ShardStats`
    taken: dict[int, int]  # `StepJournal.taken`
    partial: Partial | None  # `StepJournal.partial`
    closed: int  # `ShardState.closed`
    loads: int  # the number of the last module load taken


class ReplicaLink(Protocol):
    """Where a shard's closed steps go: its replica's server (a transport's, `RankTransport.replica_link`). Every
    call comes with the shard's lock held."""

    to: str | None  # the RPC name of the server that keeps the replica now; None: none

    def send(self, record: StepRecord) -> None:
        """Send `record` there, answered once the replica holds it (nothing when the shard has no replica)."""
        ...

    def hold(self, name: str) -> None:
        """Keep the records from now on until `release` (the server of RPC name `name` builds a replica from a
        copy; nothing more once it is recorded dead)."""
        ...

    def release(self, name: str) -> None:
        """Send the records kept to the server of RPC name `name`, the shard's replica from now on."""
        ...


class StepJournal:
    """The changes of the step in flight on one shard, sent on (`send`, None: kept nowhere) once it closes."""

    def __init__(self, send: Callable[[StepRecord], None] | None):
        self.send = send
        self.entries: list[tuple] = []
        self.taken: dict[int, int] = {}  # worker -> closed steps that took its push
        self.partial: Partial | None = None  # the last closed step's norm part, when it was held
        self._closing: tuple[tuple[int, ...], Partial | None] = ((), None)

    def record(self, name: str, *args) -> None:
        self.entries.append((name, args))

    def closing(self, workers, partial: Partial | None) -> None:
        """The step that closes next took the pushes of `workers`; `partial`: its norm's part (a held step)."""
        self._closing = (tuple(sorted(workers)), partial)

    def closed(self, stats) -> None:
        """The step has closed: count it for its workers and send what it changed on (the caller holds the shard's
        lock, so no worker hears of the step before its replica holds it)."""
        workers, self.partial = self._closing
        for w in workers:
            self.taken[w] = self.taken.get(w, 0) + 1
        self._closing = ((), None)
        self.flush(workers, stats)

    def flush(self, workers: tuple[int, ...] = (), stats=None) -> None:
        """Send what is recorded (a load's changes are sent at once, not with a step)."""
        entries, self.entries = self.entries, []
        if self.send is not None:
            self.send(StepRecord(entries, workers, self.partial, copy.deepcopy(stats)))

    def took(self, worker: int, done: int | None) -> bool:
        """Whether the step in flight of `worker`, which has been answered `done` closed steps by this shard, is
        closed here already (its answer was lost with the primary that closed it)."""
        return done is not None and self.taken.get(worker, 0) > done


def replay(shard, record: StepRecord) -> None:
    """Run the calls of `record`, a closed step of its primary, on `shard`, its replica (a `ShardState` with a
    journal), as the primary ran them; then take the primary's counters. Call with `shard.lock` held."""
    shard.journal.closing(record.workers, record.partial)
    for name, args in record.entries:
        getattr(shard, name)(*args)
    shard.stats = record.stats


class Replays:
    """A replica's step records, replayed on `shard` in the order they came, on a thread of their own; `failed` is
    told the traceback of one that cannot be (the server's failure)."""

    def __init__(self, shard, failed: Callable[[str], None]):
        self.shard, self.failed = shard, failed
        self._records: queue.Queue[StepRecord] = queue.Queue()
        threading.Thread(target=self._run, name=f"gradsync-replica-{shard.shard_id}", daemon=True).start()

    def put(self, record: StepRecord) -> None:
        self._records.put(record)

    def settle(self) -> None:
        """Wait until every record taken is replayed."""
        if self._records.unfinished_tasks:
            self._records.join()

    def _run(self) -> None:
        while True:
            record = self._records.get()
            try:
                with self.shard.lock:
                    replay(self.shard, record)
            except Exception:  # noqa: BLE001 -- the server's failure, told as such
                self.failed(traceback.format_exc())
            finally:
                self._records.task_done()
