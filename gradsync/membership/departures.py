"""Workers that leave an elastic job without finishing, as its launcher sees them.

In an async or ssp ps job a worker rank that was killed by a signal, or exited without calling
gradsync.shutdown() and without recording an exception, has departed: the launcher records it gone in the
store (`member_keys.record_gone`), so that the servers stop expecting it (an ssp bound no longer waits for it)
and no rank calls it silent, says so on stderr, and lets the others finish. An exception in a worker is a
bug in the script and fails the job, as in sync mode; so do a server's death and the departure of every
worker. When the job has ended, the servers' final counters (`stats-<shard>.json` in the run directory)
give the steps each departed worker had taken, and the launcher reports them.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import signal
import sys
import time

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.membership import lost_servers
from gradsync.membership.member_keys import parse_gone, parse_left, record_gone
from gradsync.membership.rank_reports import error_file


@dataclasses.dataclass
class Departure:
    """A worker that left an elastic job without finishing."""

    worker: int
    rank: int
    how: str
    """'killed by SIGKILL', 'exited with code 3', 'exited without calling gradsync.shutdown()'."""
    seconds: float
    """When the launcher saw it go, in seconds since the job started."""
    step: int | None = None
    """The steps of it the servers applied (its step when it left), known once the job has ended."""

    def __str__(self) -> str:
        at = "" if self.step is None else f" at step {self.step}"
        return f"worker{self.worker} (rank {self.rank}) left{at} ({self.how}), {self.seconds:.1f} s into the job"


class Results(list):
    """What `gradsync.launch` returns: the workers' return values in worker order (None for a worker that
    departed), and `departures`: the workers that left an elastic job without finishing."""

    def __init__(self, values: list, departures: list[Departure]):
        super().__init__(values)
        self.departures = departures


class Departures:
    """The departures of one launched elastic job's workers."""

    def __init__(self, config: JobConfig, store: dist.Store, run_dir: str):
        self.config = config
        self.store = store
        self.run_dir = run_dir
        self.start = time.monotonic()
        self.found: dict[int, Departure] = {}  # by rank
        self._finished: set[int] = set()  # worker ranks that exited after gradsync.shutdown()

    def observe(self, codes: list[int | None]) -> bool:
        """Record the workers that departed, given every rank's exit code (None: running); returns True when
        every worker of the job (joined ones too) is gone, so it cannot finish."""
        new = False
        for rank in range(self.config.servers, len(codes)):
            code = codes[rank]
            if code is None or rank in self.found or rank in self._finished:
                continue
            how = self._how(rank, code)
            if how is None:
                continue
            worker = rank - self.config.servers
            record_gone(self.store, worker, how)
            if self.config.replicated:  # it stays listed in the RPC group, where joining processes take it off
                lost_servers.record_dead(self.store, self.config.role(rank))
            self.found[rank] = Departure(worker, rank, how, time.monotonic() - self.start)
            print(f"gradsync: {self.found[rank]}; the job goes on without it", file=sys.stderr, flush=True)
            new = True
        if not new:
            return False
        workers, gone = self.store.multi_get([StoreKeys.WORKERS, StoreKeys.GONE])
        return len(parse_gone(gone)) >= int(workers)

    def _how(self, rank: int, code: int) -> str | None:
        """How worker rank `rank` left, given its exit code; None when it finished, or failed (an exception:
        the job fails)."""
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        if code == 0:
            if rank - self.config.servers in parse_left(self.store.get(StoreKeys.LEFT)):
                self._finished.add(rank)
                return None
            return "exited without calling gradsync.shutdown()"
        if os.path.exists(error_file(self.run_dir, rank)):
            return None
        return f"exited with code {code}"

    def describe(self) -> str:
        return "; ".join(str(d) for d in self.found.values())

    def report(self) -> list[Departure]:
        """Once the job has ended: each departure with its step, said on stderr."""
        applied = []
        for path in glob.glob(os.path.join(self.run_dir, "stats-*.json")):
            with open(path) as f:
                applied.append(json.load(f)["pushes_by_worker"])
        for d in self.found.values():
            d.step = min((int(a.get(str(d.worker), 0)) for a in applied), default=None)
            print(f"gradsync: the job finished without a worker: {d}", file=sys.stderr, flush=True)
        return list(self.found.values())
