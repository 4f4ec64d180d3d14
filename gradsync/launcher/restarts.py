"""Replacing a job's dead workers (worker_loss wait, or drop with max_restarts), as its launcher sees them;
and a job whose server died run again from its checkpoint (`job_restart`, with max_restarts).

`supervision.supervise` asks `Restarts.take` about each worker that died (killed, exited non-zero, or silent past
step_timeout, which the launcher kills first). Within max_restarts for that worker, it clears what the dead
process left for its launcher (its error file, the job's failure it recorded, its exit note), starts the
replacement with the same rank (GRADSYNC_REPLACEMENT and TORCHELASTIC_RESTART_COUNT set to its number:
`runtime.replacement`) and says so in one line; `check` says, in one more, when each replacement has rejoined (its
Trainer built) and at which step it continues, and fails the job naming the worker when one has not within
restart_timeout of the death. Under drop, the dead worker is recorded gone (the job goes on without it) and,
once its replacement has joined, back (`member_keys.record_back`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig
from gradsync.core.errors import JobFailed
from gradsync.core.job_names import StoreKeys
from gradsync.core.settings import REPLACEMENT, RESTART_COUNT
from gradsync.core.strategies import traits
from gradsync.membership import lost_servers
from gradsync.membership.heartbeat import Watch
from gradsync.membership.member_keys import record_back, record_gone, workers_in_order
from gradsync.membership.rank_reports import error_file, recorded_error
from gradsync.runtime import checkpoints, replacement

_T = TypeVar("_T")


def restarting(config: JobConfig, run: Callable[[JobConfig, int], _T]) -> _T:
    """`run(config, restarts)`: one run of a whole job (the `restarts`-th restart), run again from its checkpoint
    while a server's death causes its failure and the job may restart (`job_restart`)."""
    restarts = 0
    while True:
        try:
            return run(config, restarts)
        except JobFailed as failure:
            again = job_restart(config, failure, restarts)
            if again is None:
                raise
            config, restarts = again, restarts + 1


def job_restart(config: JobConfig, failure: JobFailed, restarts: int) -> JobConfig | None:
    """The settings to run the whole job again with, from its latest complete checkpoint, when a server caused
    `failure` and the job may restart (`restarts` so far < max_restarts, a checkpoint in checkpoint_dir): said in
    one line, every worker then redoes the steps it took after the checkpoint's; None when it may not (the job
    fails as it is)."""
    if failure.rank is None or failure.rank >= config.servers or restarts >= config.max_restarts:
        return None
    if not config.checkpoint_dir:
        return None
    try:
        found = checkpoints.latest_complete(config.checkpoint_dir)
    except (FileNotFoundError, ConfigError):
        return None
    headline = str(failure).partition("\n")[0].rstrip(":")
    print(
        f"gradsync: {headline}; restarting the whole job from its checkpoint of step {found.step} ({found.path}; "
        f"restart {restarts + 1} of {config.max_restarts}): every worker redoes the steps it took after step "
        f"{found.step}",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(config, resume=config.checkpoint_dir, start_over=False)


_meanwhile = {
    "sync": "the step in flight waits for it",
    "ssp": "the others go on within the staleness bound",
    "async": "the others go on",
}
"""What the job does while a dead worker's replacement starts, by mode."""

_WITHOUT = "the job goes on without it, and the replacement joins at a step boundary"
"""What a sync job with worker_loss drop does while a dead worker's replacement starts."""


def replacement_environment(number: int) -> dict[str, str]:
    """The variables that make a worker's process its `number`-th replacement."""
    return {REPLACEMENT.env: str(number), RESTART_COUNT.env: str(number)}


def say_replaced(config: JobConfig, rank: int, died: float, then: str) -> None:
    """The launcher's line that the replacement of `rank`, which died at `died` (time.monotonic()), has taken its
    place, and what it does (`then`)."""
    print(
        f"gradsync: {config.role(rank)} (rank {rank}) replaced {time.monotonic() - died:.1f} s after it died; {then}",
        file=sys.stderr,
        flush=True,
    )


def death(code: int) -> str:
    """How a rank's process ended, from its exit status (negative: the signal that ended it)."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class Restarts:
    """The replacements of one job's dead workers: how many each worker rank has had, which are on their way."""

    def __init__(self, config: JobConfig, store: dist.Store, run_dir: str, start: Callable[[int, int], object]):
        """`start(rank, number)`: the `number`-th replacement of worker rank `rank`, started (a RankProcess)."""
        self.config, self.store, self.run_dir, self.start = config, store, run_dir, start
        self.counts: dict[int, int] = {}  # rank -> replacements started
        self.coming: dict[int, tuple[int, float, str]] = {}  # rank -> (replacement number, when its worker died, how)
        self.late: set[int] = set()  # drop: replacements stopped because the job ended before they joined
        self.began = time.monotonic()

    def take(self, ranks: list, rank: int, how: str, watch: Watch) -> bool:
        """Replace the worker of `rank`, which died (`how`), when the job's policy allows; False when it does not
        (a server, no restarts left): the job fails."""
        if not self.allows(rank):
            return False
        self._say_rejoined(rank)  # a replacement that rejoined and died again between two looks: said first
        config, number = self.config, self.counts.get(rank, 0) + 1
        error = recorded_error(self.run_dir, rank)  # an exception of its own: said, since its file is cleared
        if error:
            how += f" ({error.strip().splitlines()[-1]})"
        if config.readmits_workers:  # the job goes on without it until its replacement joins
            record_gone(self.store, rank - config.servers, how)
        if config.replicated:  # it stays listed in the RPC group, where joining processes take it off
            lost_servers.record_dead(
                self.store, dataclasses.replace(config, rank=rank, replacement=number - 1).rpc_identity[0]
            )
        self._forget(rank)
        if traits(config.strategy).process_group:  # the survivors and the replacement form the next generation
            self.store.add(StoreKeys.GENERATION, 1)
        ranks[rank] = self.start(rank, number)
        watch.forget(rank)
        self.counts[rank] = number
        self.coming[rank] = (number, time.monotonic(), how)
        print(
            f"gradsync: {config.role(rank)} (rank {rank}) {how}, {time.monotonic() - self.began:.1f} s into the "
            f"job; starting its replacement (restart {number} of {config.max_restarts}): "
            + (_WITHOUT if config.readmits_workers else _meanwhile[config.mode]),
            file=sys.stderr,
            flush=True,
        )
        return True

    def stop_late(self, ranks: list, codes: list[int | None]) -> None:
        """Under drop: once every other worker has finished (exited 0), the job has ended without the replacements
        still on their way; stop each (once, saying so: it counts as finished, `late`) and set its code to None."""
        config = self.config
        others = [c for r, c in enumerate(codes) if r >= config.servers and r not in self.coming and r not in self.late]
        if config.readmits_workers and self.coming and others and all(code == 0 for code in others):
            for rank in list(self.coming):
                del self.coming[rank]
                if ranks[rank].exitcode() is None:
                    ranks[rank].kill(signal.SIGKILL)
                self.late.add(rank)
                print(
                    f"gradsync: the job ended before the replacement of {config.role(rank)} (rank {rank}) joined it; "
                    "it was stopped",
                    file=sys.stderr,
                    flush=True,
                )
        for rank in self.late:
            codes[rank] = None

    def spent(self, failure: JobFailed) -> JobFailed:
        """`failure`, whose cause is a worker with no restart left, saying so after its headline."""
        rank = failure.rank
        if rank is None or rank < self.config.servers:
            return failure
        headline, _, rest = str(failure).partition("\n")
        said = f" ({self.counts.get(rank, 0)} of max_restarts {self.config.max_restarts} restarts spent)"
        return JobFailed(headline.rstrip(":") + said + (":" if headline.endswith(":") else "") + "\n" + rest, rank)

    def allows(self, rank: int) -> bool:
        """Whether the worker of `rank` may be replaced now: a worker with restarts left."""
        return rank >= self.config.servers and self.counts.get(rank, 0) < self.config.max_restarts

    def check(self) -> None:
        """Say which replacements have rejoined since the last look.

        Raises:
            JobFailed: a replacement has not rejoined within restart_timeout of its worker's death, naming it.
        """
        config = self.config
        for rank, (_, died, how) in list(self.coming.items()):
            if not self._say_rejoined(rank) and time.monotonic() - died > config.restart_timeout:
                raise JobFailed(
                    f"rank {rank} ({config.role(rank)}) {how}, and its replacement did not rejoin the job within "
                    f"restart_timeout ({config.restart_timeout:g} s; --restart-timeout)",
                    rank,
                )

    def _say_rejoined(self, rank: int) -> bool:
        """Say that the replacement of `rank` on its way has rejoined, once it has; whether it has."""
        if rank not in self.coming:
            return False
        number, died, _ = self.coming[rank]
        step = replacement.rejoined(self.store, rank - self.config.servers, number)
        if step is None:
            return False
        del self.coming[rank]
        if self.config.readmits_workers:
            record_back(self.store, rank - self.config.servers)
        joins = "joins the job at step" if self.config.readmits_workers else "continues from step"
        say_replaced(self.config, rank, died, f"the replacement {joins} {step}")
        return True

    def _forget(self, rank: int) -> None:
        """Clear what the dead process of `rank` left for its launcher: its error file, the job's failure when it
        recorded it, its note of an exit without gradsync.shutdown()."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(error_file(self.run_dir, rank))
        store = self.store
        if store.check([StoreKeys.FAILED]) and store.get(StoreKeys.FAILED).decode().startswith(f"rank {rank}:"):
            store.delete_key(StoreKeys.FAILED)
        worker = rank - self.config.servers
        exited = workers_in_order(store.get(StoreKeys.EXITED))
        if worker in exited:
            store.set(StoreKeys.EXITED, "".join(f"{w}," for w in exited if w != worker))
