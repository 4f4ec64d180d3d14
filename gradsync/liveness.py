"""Liveness: every rank's heartbeat in the rendezvous store, who fell silent or left, and dying with the launcher.

From `gradsync.init` on, each rank runs a `Heartbeat`: a daemon thread that, on a store connection of its
own (a blocking store call of the main thread cannot delay it), adds 1 to `gradsync/alive/<rank>` every
`interval(step_timeout)` seconds and reads every rank's counter. A counter that stops moving belongs to a
process that is stopped (SIGSTOP), hung below Python with the GIL held, or dead; `Watch` turns the counters
into seconds of silence on the reader's own clock, so no clocks are compared across machines. A worker that
leaves (`gradsync.shutdown`) appends `worker:steps,` to `gradsync/left`, so a peer waiting for a step the
leaver will never take can fail at once, naming it. In an elastic job (async or ssp ps) a worker that died
is recorded in `gradsync/gone` (by the launcher, or by a server for a joined worker gone silent), and counts
as left; `gradsync/workers` counts the worker indices handed out, so workers that join are watched too. The
launcher reads the same keys.

Why heartbeats through the store, not only the launcher's view of its processes: they also work under
torchrun and across machines, every rank can name a silent peer in its own error, and they cost one small
store write and one read per rank per interval. The launcher adds what only it can see: exit codes and
process states.

A rank started by gradsync's launcher (GRADSYNC_LAUNCHER_PID set) dies with it: the kernel sends it SIGKILL
when the launcher exits (prctl PR_SET_PDEATHSIG, Linux), and the heartbeat checks the parent pid as well.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import threading
import time
from typing import Callable

import torch.distributed as dist

from gradsync.config import JobConfig, StoreKeys

LAUNCHER_PID = "GRADSYNC_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def interval(step_timeout: float) -> float:
    """Seconds between heartbeats: 1, or five per step timeout when that is shorter than 5 s."""
    return min(1.0, step_timeout / 5)


def create_keys(store: dist.Store, world_size: int, workers: int) -> None:
    """Create every rank's counter, the lists of leavers and the count of workers (`workers`, unless set
    already), so that reading them never waits."""
    for rank in range(world_size):
        store.add(StoreKeys.ALIVE.format(rank), 0)
    store.append(StoreKeys.LEFT, "")
    store.append(StoreKeys.GONE, "")
    store.compare_set(StoreKeys.WORKERS, "", str(workers))


def parse_left(raw: bytes) -> dict[int, int]:
    """{worker: steps it had taken} from the `worker:steps,` entries of the LEFT key."""
    return {int(w): int(s) for w, s in (item.split(":") for item in raw.decode().split(",") if item)}


def parse_gone(raw: bytes) -> dict[int, str]:
    """{worker: how it went} from the `worker:how` lines of the GONE key (the first line per worker)."""
    gone: dict[int, str] = {}
    for line in raw.decode().splitlines():
        worker, _, how = line.partition(":")
        gone.setdefault(int(worker), how)
    return gone


def record_gone(store: dist.Store, worker: int, how: str) -> None:
    """Record that `worker` left an elastic job without gradsync.shutdown() (`how`: 'killed by SIGKILL'...)."""
    store.append(StoreKeys.GONE, f"{worker}:{how}\n")


def staying(store: dist.Store) -> list[int]:
    """The workers in the job now: every index handed out, less those that left or are gone."""
    workers, left, gone = store.multi_get([StoreKeys.WORKERS, StoreKeys.LEFT, StoreKeys.GONE])
    return sorted(set(range(int(workers))) - set(parse_left(left)) - set(parse_gone(gone)))


class Watch:
    """When each rank's heartbeat counter last moved, by this process's clock, and which workers left."""

    def __init__(self, config: JobConfig):
        self.config = config
        self.counts = [0] * config.world_size
        self.moved: list[float | None] = [None] * config.world_size  # None: has not beaten yet
        self.read_at = time.monotonic()
        self.left: dict[int, int | None] = {}  # worker: steps it had taken (None: gone, see `gone`)
        self.gone: dict[int, str] = {}
        self._noticed: dict[int, float] = {}  # rank of a joined worker: when this watch first saw its index

    def read(self, store: dist.Store) -> dict[int, int | None]:
        """Read every counter and the leavers; returns {worker: steps, or None when it is gone} of those that
        left since the last read."""
        keys = [StoreKeys.ALIVE.format(rank) for rank in range(len(self.counts))]
        *counts, left, gone, workers = store.multi_get(keys + [StoreKeys.LEFT, StoreKeys.GONE, StoreKeys.WORKERS])
        self.read_at = time.monotonic()
        for rank, raw in enumerate(counts):
            if int(raw) != self.counts[rank]:
                self.counts[rank], self.moved[rank] = int(raw), self.read_at
        self._watch_joined(store, self.config.servers + int(workers))
        new: dict[int, int | None] = {w: s for w, s in parse_left(left).items() if w not in self.left}
        for worker, how in parse_gone(gone).items():
            if worker not in self.left and worker not in new:
                new[worker] = None
                self.gone[worker] = how
        self.left.update(new)
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

    def silent(self, seconds: float) -> dict[int, float]:
        """{rank: seconds} of the ranks that have beaten, but not for `seconds` up to the last read (a pause of
        this reader never counts against them); workers that left are not expected to beat."""
        gone = {self.config.servers + w for w in self.left}
        return {rank: self.read_at - moved for rank, moved in enumerate(self.moved)
                if moved is not None and rank not in gone and self.read_at - moved >= seconds}

    def describe(self, silent: dict[int, float]) -> str:
        """One clause per silent rank, naming it."""
        return "; ".join(f"rank {rank} ({self.config.role(rank)}) has sent no heartbeat for {seconds:.1f} s"
                         for rank, seconds in silent.items())


class Heartbeat:
    """This rank's heartbeat thread and its `Watch` of every rank."""

    def __init__(self, store: dist.Store, config: JobConfig):
        self.config = config
        self.watch = Watch(config)
        self._store = store.clone()
        self._store.set_timeout(datetime.timedelta(seconds=config.step_timeout))
        create_keys(self._store, config.world_size, config.num_workers)
        self._listeners: list[Callable[[int, int | None], None]] = []
        self._stop = threading.Event()
        self._launcher = launcher_pid()
        threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True).start()

    def on_left(self, listener: Callable[[int, int | None], None]) -> None:
        """Call `listener(worker, steps)`, on the heartbeat thread, for each worker that leaves the job (steps
        None: it is gone without leaving, from an elastic job)."""
        self._listeners.append(listener)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        key = StoreKeys.ALIVE.format(self.config.rank)
        while True:
            if self._launcher is not None and os.getppid() != self._launcher:
                _orphaned(self._launcher)
            try:
                self._store.add(key, 1)
                left = self.watch.read(self._store)
            except dist.DistError:  # the store is gone: the job is ending, or its host died
                left = {}
            for worker, steps in left.items():
                for listener in self._listeners:
                    listener(worker, steps)
            if self._stop.wait(interval(self.config.step_timeout)):
                return


def launcher_pid() -> int | None:
    """The pid of the gradsync launcher that started this process, if one did."""
    raw = os.environ.get(LAUNCHER_PID)
    return int(raw) if raw else None


def die_with_launcher() -> None:
    """In a rank started by gradsync's launcher: have the kernel SIGKILL this process when the launcher dies
    (Linux; elsewhere the heartbeat's parent check does it within a beat), and exit now if it already has."""
    launcher = launcher_pid()
    if launcher is None:
        return
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:
        _orphaned(launcher)


def _orphaned(launcher: int) -> None:
    sys.stderr.write(f"gradsync: the launcher (pid {launcher}) is gone, so this rank (pid {os.getpid()}) exits\n")
    sys.stderr.flush()
    os._exit(1)
