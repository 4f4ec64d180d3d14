"""Every rank's heartbeat in the rendezvous store, and its watch of who fell silent, stalled or left.

From `gradsync.init` on, each rank runs a `Heartbeat`: a daemon thread that, on a store connection of its
own (a blocking store call of the main thread cannot delay it), adds 1 to `gradsync/alive/<rank>` every
`interval(step_timeout)` seconds and reads every rank's counter. A counter that stops moving belongs to a
process that is stopped (SIGSTOP), hung below Python with the GIL held, or dead; `Watch` turns the counters
into seconds of silence on the reader's own clock, so no clocks are compared across machines. A worker that
leaves (`gradsync.shutdown`) appends `worker:steps,` to `gradsync/left`, so a peer waiting for a step the
leaver will never take can fail at once, naming it; a worker gone from an elastic job counts as left (the keys:
`member_keys`). The launcher reads the same keys with a `Watch` of its own.

A worker's heartbeat also adds 1 to `gradsync/moved/<rank>` at each beat where its main thread is somewhere else
than at the last (another frame or instruction): a counter that stops moving while the heartbeat goes on belongs
to a worker whose main thread waits (a lock, a DataLoader, a peer): `Watch.stalled`, which the launcher answers
with every rank's stack (`rank_reports`). A server's main thread waits in `serve` until the job ends: not watched.

Why heartbeats through the store, not only the launcher's view of its processes: they also work under
torchrun and across machines, every rank can name a silent peer in its own error, and they cost one small
store write and one read per rank per interval. The launcher adds what only it can see: exit codes and
process states. The heartbeat thread also ends this rank when its launcher is gone (`launcher_death`).
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys, worker_name
from gradsync.membership.launcher_death import watch_launcher
from gradsync.membership.member_keys import create_keys, deaths, parse_gone, parse_left, parse_workers, ranks_named


def interval(step_timeout: float) -> float:
    """Seconds between heartbeats: 1, or five per step timeout when that is shorter than 5 s."""
    return min(1.0, step_timeout / 5)


NO_TRAINER = "no gradsync.Trainer built"
"""What `Watch.describe_without_trainer` says of a worker, in the launcher's headline and a rank's hint."""


class Watch:
    """When each rank's heartbeat counter last moved, by this process's clock, and which workers left."""

    def __init__(self, config: JobConfig):
        self.config = config
        self.counts = [0] * config.world_size
        self.moved: list[float | None] = [None] * config.world_size  # None: has not beaten yet
        self.read_at = time.monotonic()
        self.left: dict[int, int | None] = {}  # worker: steps it had taken (None: gone, see `gone`)
        self.gone: dict[int, str] = {}  # workers gone now: how they went
        self._deaths: dict[int, int] = {}  # worker: its processes that died (`member_keys.deaths`)
        self._noticed: dict[int, float] = {}  # rank of a joined worker: when this watch first saw its index
        self.trainers: dict[int, float] = {}  # worker: when this watch first saw it begin to build its Trainer
        self.places = [0] * config.world_size  # of the job's first ranks: MOVED, where each worker's main thread is
        self.placed: list[float | None] = [None] * config.world_size  # when `places` last changed, from the first beat

    def read(self, store: dist.Store) -> list[tuple[int, int | None]]:
        """Read every counter and the leavers; returns (worker, steps) of those that left since the last read,
        steps None for each of its processes that died (a worker's replacements may die too)."""
        keys = [StoreKeys.ALIVE.format(rank) for rank in range(len(self.counts))]
        keys += [StoreKeys.MOVED.format(rank) for rank in range(self.config.world_size)]
        *counts, left, gone, workers, trainers = store.multi_get(
            keys + [StoreKeys.LEFT, StoreKeys.GONE, StoreKeys.WORKERS, StoreKeys.TRAINERS]
        )
        counts, places = counts[: len(self.counts)], counts[len(self.counts) :]
        self.read_at = time.monotonic()
        for rank, raw in enumerate(places):
            if int(raw) != self.places[rank] or (self.placed[rank] is None and int(counts[rank])):
                self.places[rank], self.placed[rank] = int(raw), self.read_at
        for worker in parse_workers(trainers):
            self.trainers.setdefault(worker, self.read_at)
        for rank, raw in enumerate(counts):
            if int(raw) != self.counts[rank]:
                self.counts[rank], self.moved[rank] = int(raw), self.read_at
        self._watch_joined(store, self.config.servers + int(workers))
        new: list[tuple[int, int | None]] = [(w, s) for w, s in parse_left(left).items() if w not in self.left]
        self.left.update(new)
        now = parse_gone(gone)
        for worker in [w for w in self.gone if w not in now]:  # back: its replacement joined the job again
            del self.gone[worker], self.left[worker]
        for worker, how in now.items():
            if worker not in self.left:
                self.left[worker], self.gone[worker] = None, how
        for worker, count in deaths(gone).items():
            if worker in self.gone or worker not in self.left:  # each of its deaths since the last read
                new += [(worker, None)] * (count - self._deaths.get(worker, 0))
            self._deaths[worker] = count
        return new

    def _watch_joined(self, store: dist.Store, ranks: int) -> None:
        """Watch the workers that joined, in rank order, each once its counter is in the store (a joiner
        creates it right after taking its index, then beats): silent from when it was first noticed until it
        beats. A counter missing for startup_timeout is created here (its joiner died before): then it is
        silent, and a server records it gone."""
        while len(self.counts) < ranks:
            rank = len(self.counts)
            noticed = self._noticed.setdefault(rank, self.read_at)
            if not store.check([StoreKeys.ALIVE.format(rank)]):
                if self.read_at - noticed < self.config.startup_timeout:
                    return
                store.add(StoreKeys.ALIVE.format(rank), 0)
            self.counts.append(0)
            self.moved.append(noticed)

    def forget(self, rank: int) -> None:
        """A new process of `rank` (a dead worker's replacement) is starting: it has not beaten yet."""
        self.moved[rank] = self.placed[rank] = None

    def silent(self, seconds: float) -> dict[int, float]:
        """{rank: seconds} of the ranks that have beaten, but not for `seconds` up to the last read (a pause of
        this reader never counts against them); workers that left are not expected to beat."""
        gone = {self.config.servers + w for w in self.left}
        return {
            rank: self.read_at - moved
            for rank, moved in enumerate(self.moved)
            if moved is not None and rank not in gone and self.read_at - moved >= seconds
        }

    def stalled(self, seconds: float) -> dict[int, float]:
        """{rank: seconds} of the job's first workers whose main thread has stayed at the same place for
        `seconds` up to the last read while their heartbeat went on (none that left)."""
        silent = self.silent(seconds)
        gone = {self.config.servers + w for w in self.left}
        return {
            rank: self.read_at - placed
            for rank, placed in enumerate(self.placed)
            if rank >= self.config.servers
            and placed is not None
            and rank not in gone
            and rank not in silent
            and self.read_at - placed >= seconds
        }

    def absent(self) -> list[int]:
        """The ranks of the job's first processes that have not beaten yet: not yet in `gradsync.init`."""
        return [rank for rank in range(self.config.world_size) if self.moved[rank] is None]

    def without_trainer(self, seconds: float) -> list[int]:
        """The job's first workers (none that left) that have not begun to build their Trainer although another
        worker began `seconds` ago or more (up to the last read); [] when none began that long ago."""
        if not self.trainers or self.read_at - min(self.trainers.values()) < seconds:
            return []
        return [w for w in range(self.config.num_workers) if w not in self.trainers and w not in self.left]

    def describe_without_trainer(self, workers: list[int]) -> str:
        first = min(self.trainers, key=self.trainers.__getitem__)
        return (
            f"{ranks_named(self.config, [self.config.servers + w for w in workers])}: {NO_TRAINER} "
            f"{self.read_at - self.trainers[first]:.0f} s after {worker_name(first)} began to build "
            "its own, and every worker must build one (the others wait for it)"
        )

    def describe(self, silent: dict[int, float]) -> str:
        """One clause per silent rank, naming it."""
        return "; ".join(
            f"rank {rank} ({self.config.role(rank)}) has sent no heartbeat for {seconds:.1f} s"
            for rank, seconds in silent.items()
        )


class Heartbeat:
    """This rank's heartbeat thread and its `Watch` of every rank."""

    def __init__(self, store: dist.Store, config: JobConfig):
        self.config = config
        self.watch = Watch(config)
        # Store.clone: missing from torch's stubs
        self._store = store.clone()  # type: ignore[attr-defined]
        self._store.set_timeout(datetime.timedelta(seconds=config.step_timeout))
        create_keys(self._store, config.world_size, config.num_workers)
        self._listeners: list[Callable[[int, int | None], None]] = []
        self._stop = threading.Event()
        self._launcher = watch_launcher()
        self._thread = threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True)
        self._thread.start()

    def on_left(self, listener: Callable[[int, int | None], None]) -> None:
        """Call `listener(worker, steps)`, on the heartbeat thread, for each worker that leaves the job (steps
        None: it is gone without leaving, from an elastic job)."""
        self._listeners.append(listener)

    def stop(self, timeout: float | None = None) -> None:
        """Stop beating, and wait up to `timeout` seconds for the thread to end (its store calls are bounded by
        step_timeout). A daemon thread still inside a store call as the interpreter exits is ended when it takes
        the GIL back, an unwinding that C++ cannot do: `terminate called without an active exception`, SIGABRT."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        key = StoreKeys.ALIVE.format(self.config.rank)
        moved = StoreKeys.MOVED.format(self.config.rank)
        place = None
        while True:
            if self._launcher is not None:
                self._launcher.exit_if_gone()
            try:
                self._store.add(key, 1)
                if not self.config.is_server and self.config.rank < self.config.world_size:
                    place, before = _main_thread_place(), place
                    if place != before:
                        self._store.add(moved, 1)
                left = self.watch.read(self._store)
            except dist.DistError:  # the store is gone: the job is ending, or its host died
                left = []
            for worker, steps in left:
                for listener in self._listeners:
                    listener(worker, steps)
            if self._stop.wait(interval(self.config.step_timeout)):
                return


def _main_thread_place() -> tuple:
    """Where this process's main thread is: each frame's code and instruction, innermost first."""
    ident = threading.main_thread().ident
    frame = None if ident is None else sys._current_frames().get(ident)
    place = []
    while frame is not None:
        place.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(place)
