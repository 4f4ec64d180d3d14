"""Liveness: every rank's heartbeat in the rendezvous store, who fell silent or left, and dying with the launcher.

From `gradsync.init` on, each rank runs a `Heartbeat`: a daemon thread that, on a store connection of its
own (a blocking store call of the main thread cannot delay it), adds 1 to `gradsync/alive/<rank>` every
`interval(step_timeout)` seconds and reads every rank's counter. A counter that stops moving belongs to a
process that is stopped (SIGSTOP), hung below Python with the GIL held, or dead; `Watch` turns the counters
into seconds of silence on the reader's own clock, so no clocks are compared across machines. A worker that
leaves (`gradsync.shutdown`) appends `worker:steps,` to `gradsync/left`, so a peer waiting for a step the
leaver will never take can fail at once, naming it. The launcher reads the same keys.

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


def create_keys(store: dist.Store, world_size: int) -> None:
    """Create every rank's counter and the list of leavers, so that reading them never waits."""
    for rank in range(world_size):
        store.add(StoreKeys.ALIVE.format(rank), 0)
    store.append(StoreKeys.LEFT, "")


def parse_left(raw: bytes) -> dict[int, int]:
    """{worker: steps it had taken} from the `worker:steps,` entries of the LEFT key."""
    return {int(w): int(s) for w, s in (item.split(":") for item in raw.decode().split(",") if item)}


class Watch:
    """When each rank's heartbeat counter last moved, by this process's clock, and which workers left."""

    def __init__(self, config: JobConfig):
        self.config = config
        self.counts = [0] * config.world_size
        self.moved: list[float | None] = [None] * config.world_size  # None: has not beaten yet
        self.read_at = time.monotonic()
        self.left: dict[int, int] = {}

    def read(self, store: dist.Store) -> dict[int, int]:
        """Read every counter and the leavers; returns {worker: steps} of those that left since the last read."""
        keys = [StoreKeys.ALIVE.format(rank) for rank in range(self.config.world_size)]
        *counts, left = store.multi_get(keys + [StoreKeys.LEFT])
        self.read_at = time.monotonic()
        for rank, raw in enumerate(counts):
            if int(raw) != self.counts[rank]:
                self.counts[rank], self.moved[rank] = int(raw), self.read_at
        new = {w: s for w, s in parse_left(left).items() if w not in self.left}
        self.left.update(new)
        return new

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
        create_keys(self._store, config.world_size)
        self._listeners: list[Callable[[int, int], None]] = []
        self._stop = threading.Event()
        self._launcher = launcher_pid()
        threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True).start()

    def on_left(self, listener: Callable[[int, int], None]) -> None:
        """Call `listener(worker, steps)`, on the heartbeat thread, for each worker that leaves the job."""
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
