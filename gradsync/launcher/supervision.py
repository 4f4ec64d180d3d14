"""Supervision of a local job's rank processes: watch them until they finish, explain a failure, kill them.

`supervise` watches exit codes and every rank's heartbeat (`membership.heartbeat`); when a rank fails or falls silent
for step_timeout, the launcher kills every rank (`kill_all`) and raises `JobFailed`, naming the rank that
caused it (`_root_cause`: one killed by a signal, then one that is stopped or silent, then the first to
record a failure) with its traceback. In an elastic job (async or ssp ps) a worker that dies is a departure,
not a failure (`departures`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import cast

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.errors import JobFailed, answered_worker
from gradsync.core.job_names import StoreKeys
from gradsync.core.waiting import POLL_S, wait_until
from gradsync.launcher import procfs
from gradsync.launcher.restarts import Restarts, death
from gradsync.launcher.server_loss import ServerLoss
from gradsync.membership.departures import Departure, Departures
from gradsync.membership.heartbeat import NO_TRAINER, Watch, interval
from gradsync.membership.member_keys import ranks_named, workers_in_order
from gradsync.membership.rank_reports import (
    ask_stacks,
    early_stderr,
    early_stderr_file,
    error_file,
    recorded_error,
    stack_file,
)

_KILL_GRACE_S = 3.0
_EXIT_GRACE_S = 10.0  # for a rank that recorded a failure to exit: torch's teardown takes seconds on a busy machine
_REAP_S = 10.0
"""How long reaping a rank after SIGKILL may take: the kernel ends it at once, unless it waits in uninterruptible
I/O (state D), which SIGKILL cannot interrupt; the launcher goes on rather than hang on it."""
_STATES: dict[str | None, str] = {
    "T": "its process is stopped (SIGSTOP, SIGTSTP)",
    "t": "its process is stopped by a debugger",
    "D": "its process waits in uninterruptible I/O",
}


class RankProcess:
    """One rank's process, a new one (subprocess) or forked (multiprocessing); `group`: it leads a process group
    of its own (a session), which is killed with it."""

    def __init__(self, rank: int, proc, group: bool = False):
        self.rank = rank
        self.proc = proc
        self.group = group
        self.started = time.monotonic()

    def exitcode(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def state(self) -> str | None:
        """The process's state letter in /proc (R, S, D, T, t, Z), None when it cannot be read."""
        return procfs.state(self.proc.pid)

    def kill(self, sig: int) -> None:
        if self.exitcode() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig) if self.group else os.kill(self.proc.pid, sig)
        except ProcessLookupError:  # gone, or forked and not yet the leader of its group
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)


def kill_all(ranks: list[RankProcess]) -> None:
    """SIGTERM every rank (and SIGCONT, so a stopped one handles it), SIGKILL those left after a grace period."""
    for r in ranks:
        r.kill(signal.SIGTERM)
        r.kill(signal.SIGCONT)
    _let_exit(ranks, _KILL_GRACE_S, "the ranks to exit on SIGTERM")
    for r in ranks:
        r.kill(signal.SIGKILL)
    for r in ranks:
        if isinstance(r.proc, subprocess.Popen):
            r.proc.wait(timeout=_REAP_S)
        else:
            r.proc.join(timeout=_REAP_S)


def _let_exit(ranks: list[RankProcess], seconds: float, what: str) -> None:
    """Give `ranks` up to `seconds` to exit on their own; the caller reads which did."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(r.exitcode() is not None for r in ranks), time.monotonic() + seconds, what)


def _failed(config: JobConfig, rank: int, code: int) -> str:
    """'rank 2 (worker1) failed with exit code 1' (a negative `code`: the signal that ended it)."""
    how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    return f"rank {rank} ({config.role(rank)}) failed with {how}"


def _failure_text(config: JobConfig, run_dir: str, rank: int, code: int, recorded: str | None = None) -> str:
    """A failed rank's headline with the failure it recorded (`recorded`: the job's first failure in the store,
    which may be another rank's text that blames this one)."""
    text = _failed(config, rank, code)
    recorded = recorded if recorded is not None else recorded_error(run_dir, rank)
    return text if recorded is None else text + ":\n" + recorded


_NOT_PORTED = (
    ": every script that gradsync runs must call gradsync.init() first, and nothing that starts "
    "torch.distributed itself (a DDP script's dist.init_process_group fails on the port of gradsync's "
    "store: EADDRINUSE); a script that calls gradsync.launch must call it under "
    '`if __name__ == "__main__":`'
)


def _answered_text(config: JobConfig, ranks: list[RankProcess], run_dir: str, recorded: str) -> str:
    """When `recorded`, a server's failure, names the worker whose call it failed answering (`answered_worker`):
    that worker's failure, a consequence, in one line (the last of its error), once it has exited non-zero (given a
    few seconds to); else ''."""
    worker = answered_worker(recorded)
    if worker is None or worker >= config.num_workers:
        return ""
    rank = ranks[config.servers + worker]
    _let_exit([rank], _EXIT_GRACE_S, f"{config.role(rank.rank)} to exit after the failure it caused")
    code, error = rank.exitcode(), recorded_error(run_dir, rank.rank)
    if code in (None, 0) or error is None:
        return ""
    lines = [line for line in error.splitlines() if line.strip() and not line.startswith("gradsync: ")]
    return f"\nthen {_failed(config, rank.rank, code)}" + (f": {lines[-1]}" if lines else "")


def _before_init_text(config: JobConfig, ranks: list[RankProcess], watch: Watch, run_dir: str) -> tuple[int, str]:
    """The first rank that failed before gradsync.init(), and what it printed there (its stderr, which gradsync held:
    `rank_reports`), once: the ranks that failed the same way (the same text and exit status) are named after it,
    the others' own text follows. Ranks that have not reached init are given a few seconds to exit on their own.
    A rank ended by a signal is said to be killed by it (it printed no traceback). Advice to call gradsync.init()
    only where the text does not show the script's own error: gradsync never took the stderr of a rank that
    exited (its traceback is above), or torch.distributed started without gradsync."""
    early = [r for r in ranks if watch.moved[r.rank] is None]
    _let_exit(early, _KILL_GRACE_S, "the ranks that did not reach gradsync.init() to exit")
    failed = [r for r in early if r.exitcode() not in (None, 0)]
    said = {
        r.rank: (cast(int, r.exitcode()), early_stderr(early_stderr_file(run_dir, r.rank))) for r in failed
    }  # exited
    groups: dict[tuple[int, str | None], list[int]] = {}
    for rank, what in said.items():
        groups.setdefault(what, []).append(rank)
    parts = []
    for (code, printed), same in groups.items():
        if code < 0:
            text = f"rank {same[0]} ({config.role(same[0])}) failed: killed by {signal.Signals(-code).name}"
        else:
            text = _failure_text(config, run_dir, same[0], code)
        text += " before it reached gradsync.init()"
        if printed is None:
            text += "" if code < 0 else " (its traceback is above)" + _NOT_PORTED
        else:
            text += (", printing:\n" + printed.rstrip("\n")) if printed.strip() else ", printing nothing"
            if "init_process_group" in printed:
                text += "\n" + _NOT_PORTED[2:]
        if same[1:]:
            text += f"\n{ranks_named(config, same[1:])} failed the same way"
        parts.append(text)
    return failed[0].rank, "\nthen ".join(parts)


def _absent_text(config: JobConfig, ranks: list[RankProcess]) -> str:
    """Why the job stopped: `ranks` have not reached gradsync.init() within startup_timeout of their start."""
    exited = [r.rank for r in ranks if r.exitcode() == 0]
    text = (
        f"{ranks_named(config, [r.rank for r in ranks])} did not reach gradsync.init() within startup_timeout "
        f"({config.startup_timeout:.0f} s) of its start, and the other ranks wait for every one"
    )
    if exited:
        text += f" ({ranks_named(config, exited)} exited with code 0 without calling it)"
    return text + ": is the script stuck before gradsync.init(), or does it skip it on some ranks?"


def _quit_text(config: JobConfig, rank: RankProcess, seen: bool = False) -> str:
    """Why worker `rank` stopped the job: it exited without gradsync.shutdown() while the others trained (`seen`:
    the launcher saw it exit, before anyone failed waiting for it)."""
    code = rank.exitcode()
    how = (
        "its process hangs in torch's teardown"
        if code is None
        else f"code {code}"
        if code >= 0
        else f"then torch's teardown ended it with {signal.Signals(-code).name}"
    )
    said = f"rank {rank.rank} ({config.role(rank.rank)}) exited ({how}) without gradsync.shutdown()" + (
        ", so the job cannot end (the servers wait for it to leave): "
        if seen
        else " while the others were training, so they failed waiting for it: "
    )
    if code is not None and code > 0:  # the script caught its own error and exited (hydra's main does)
        return said + (
            "its exit status says it failed, and its own output above says why (where a framework "
            "catches the exception and exits, e.g. hydra's, HYDRA_FULL_ERROR=1 shows the traceback)"
        )
    return said + (
        "every worker must call gradsync.shutdown() when it is done (for uneven data, train inside "
        "`with trainer.join():` on every worker, then call it)"
    )


def _quitters(config: JobConfig, ranks: list[RankProcess], watch: Watch, store: dist.Store) -> list[RankProcess]:
    """Workers of a job that is not elastic that reached gradsync.init() and ended without leaving the job
    (gradsync.shutdown): exited 0, or noted at their interpreter's exit (`runtime.start`; torch's teardown may then
    abort or hang them), as of the watch's last read; those noted first (the others exited after them), then by
    rank."""
    if config.elastic:
        return []
    noted = workers_in_order(store.get(StoreKeys.EXITED))
    quitters = [
        r
        for r in ranks[config.servers :]
        if watch.moved[r.rank] is not None
        and r.rank - config.servers not in watch.left
        and (r.exitcode() == 0 or r.rank - config.servers in noted)
    ]
    first = {w: i for i, w in reversed(list(enumerate(noted)))}
    return sorted(quitters, key=lambda r: first.get(r.rank - config.servers, len(noted)))  # the first to exit first


def _silent_text(config: JobConfig, rank: RankProcess, seconds: float) -> str:
    """Why running `rank` stopped the job: it stopped sending heartbeats."""
    state = _STATES.get(rank.state(), "its process runs, but not its heartbeat thread (a C call holding the GIL?)")
    return (
        f"rank {rank.rank} ({config.role(rank.rank)}) stopped responding: no heartbeat for {seconds:.1f} s "
        f"(step_timeout {config.step_timeout:.0f} s); {state}"
    )


def _recorded_failure(ranks: list[RankProcess], store: dist.Store) -> tuple[int, str] | None:
    """The rank the job's first failure in the store is recorded under (the rank that recorded it, or the
    worker its text blames) and its text, once that rank has exited non-zero (given a few seconds to)."""
    if not store.check([StoreKeys.FAILED]):
        return None
    head, text = store.get(StoreKeys.FAILED).decode().split(":", 1)
    first = ranks[int(head.split()[1])]
    _let_exit([first], _EXIT_GRACE_S, f"rank {first.rank}, which recorded the job's failure, to exit")
    return (first.rank, text.lstrip()) if first.exitcode() not in (None, 0) else None


def _absent(config: JobConfig, ranks: list[RankProcess], watch: Watch, departed: set[int]) -> list[RankProcess]:
    """Ranks that have not reached gradsync.init() (running, or exited 0) within startup_timeout of their start."""
    now = time.monotonic()
    return [
        r
        for r in ranks
        if r.rank not in departed
        and watch.moved[r.rank] is None
        and r.exitcode() in (None, 0)
        and now - r.started >= config.startup_timeout
    ]


def _root_cause(
    config: JobConfig, ranks: list[RankProcess], watch: Watch, store: dist.Store, run_dir: str, departed: set[int]
) -> JobFailed:
    """The failure that explains the others: a worker that ended without gradsync.shutdown() in a job that is
    not elastic; else a rank killed by a signal without recording a failure (it could
    not report); else ranks that never reached gradsync.init() within startup_timeout, workers that never
    built their Trainer, or a running rank that is stopped or silent for half the step timeout (the others
    failed waiting for them); else the first to record a failure; else the lowest failed rank.
    Ranks in `departed` (workers that left an elastic job) are none of these."""
    failed = [  # (rank, exit code) of the ranks that exited, not 0
        (r.rank, cast(int, r.exitcode())) for r in ranks if r.exitcode() not in (None, 0) and r.rank not in departed
    ]
    quitters = _quitters(config, ranks, watch, store)
    if quitters:
        followers = [rank for rank, _ in failed if rank != quitters[0].rank]
        then = (
            ""
            if not followers
            else "\nthen " + _failure_text(config, run_dir, followers[0], cast(int, ranks[followers[0]].exitcode()))
        )
        return JobFailed(_quit_text(config, quitters[0]) + then, quitters[0].rank)
    for rank, code in failed:
        if code < 0 and not os.path.exists(error_file(run_dir, rank)):
            if watch.moved[rank] is None:
                first, text = _before_init_text(config, ranks, watch, run_dir)
                return JobFailed(text, first)
            return JobFailed(_failure_text(config, run_dir, rank, code), rank)
    recorded = _recorded_failure(ranks, store)
    follower = recorded[0] if recorded is not None else failed[0][0]
    if recorded is None and watch.moved[follower] is None and recorded_error(run_dir, follower) is None:
        follower, follower_text = _before_init_text(config, ranks, watch, run_dir)
    else:
        code = cast(int, ranks[follower].exitcode())  # read as an exit status, as before: see the report
        follower_text = _failure_text(config, run_dir, follower, code, recorded and recorded[1])
        answered = _answered_text(config, ranks, run_dir, recorded[1]) if recorded is not None else ""
        follower_text = follower_text.rstrip("\n") + answered if answered else follower_text
    absent = _absent(config, ranks, watch, departed)
    if absent:
        return JobFailed(f"{_absent_text(config, absent)}\nthen {follower_text}", absent[0].rank)
    late = watch.without_trainer(min(config.startup_timeout, config.step_timeout) / 2)
    late = [w for w in late if ranks[config.servers + w].exitcode() in (None, 0)]
    if late:  # the follower's own hint says the same: the headline says it once
        follower_text = "\n".join(line for line in follower_text.split("\n") if NO_TRAINER not in line)
        return JobFailed(f"{watch.describe_without_trainer(late)}\nthen {follower_text}", config.servers + late[0])
    silent = watch.silent(config.step_timeout / 2)
    suspects = [
        r
        for r in ranks
        if r.rank != follower
        and r.rank not in departed
        and (r.rank in silent or r.state() in ("T", "t"))
        and r.exitcode() is None
    ]
    if suspects:
        cause = max(suspects, key=lambda r: silent.get(r.rank, 0.0))
        return JobFailed(
            f"{_silent_text(config, cause, silent.get(cause.rank, 0.0))}\nthen {follower_text}", cause.rank
        )
    return JobFailed(follower_text, follower)


def supervise(
    config: JobConfig,
    ranks: list[RankProcess],
    run_dir: str,
    store: dist.Store,
    timeout: float | None,
    replace: Callable[[int, int], RankProcess] | None = None,
) -> list[Departure]:
    """Wait until every rank has exited 0, or, in an elastic job, departed (`departures`); returns the
    departures. Raises JobFailed when one fails (naming the root cause), when every worker of an elastic job
    has departed, when a running rank has not reached gradsync.init() within startup_timeout of its start or
    has sent no heartbeat for step_timeout, or after `timeout` seconds (None: no limit). With worker_loss wait
    (or drop, with max_restarts), `replace(rank, number)` starts the `number`-th replacement of a worker that
    died (`restarts`), within max_restarts."""
    deadline = None if timeout is None else time.monotonic() + timeout
    watch = Watch(config)
    departures = Departures(config, store, run_dir) if config.elastic else None
    restarts = Restarts(config, store, run_dir, replace) if config.restarts_workers and replace is not None else None
    losses = ServerLoss(config, store, replace) if config.replicated else None
    next_read = 0.0
    exited: set[int] = set()  # worker ranks seen exiting 0 (`_quitter_seen`)
    reported: list[int] | None = None  # where each worker's main thread was at the last stall report
    try:
        while True:
            codes = [r.exitcode() for r in ranks]
            if restarts is not None:
                restarts.stop_late(ranks, codes)
                for rank, code in enumerate(codes):
                    if code not in (None, 0) and restarts.take(ranks, rank, death(code), watch):
                        codes[rank] = None
                restarts.check()
            if losses is not None:
                for rank, code in enumerate(codes[: config.servers]):
                    if code is not None and code < 0 and rank not in losses.down:  # killed: its replica serves
                        losses.take(ranks, rank, death(code), watch)
                        codes[rank] = None if rank not in losses.down else code
                try:
                    losses.check()
                except JobFailed as late:  # where the replacement waits
                    raise JobFailed(str(late) + _stacks_text(config, ranks, run_dir), late.rank) from None
            if departures is not None and departures.observe(codes):
                raise JobFailed(
                    f"every worker left the job, so it cannot finish: {departures.describe()}", min(departures.found)
                )
            departed = set(departures.found) if departures is not None else set()
            departed |= set(losses.down) if losses is not None else set()
            departed |= restarts.late if restarts is not None else set()
            if all(c == 0 or rank in departed for rank, c in enumerate(codes)):
                _show_held_stderr(ranks, run_dir)
                return departures.report() if departures is not None else []
            failed = any(c not in (None, 0) and rank not in departed for rank, c in enumerate(codes))
            if failed or time.monotonic() >= next_read:
                watch.read(store)
                next_read = time.monotonic() + interval(config.step_timeout)
            if failed:
                failure = _root_cause(config, ranks, watch, store, run_dir, departed)
                raise failure if restarts is None else restarts.spent(failure)
            if quitter := _quitter_seen(config, ranks, codes, watch, store, exited):
                raise JobFailed(_quit_text(config, quitter, seen=True), quitter.rank)
            absent = _absent(config, ranks, watch, departed)
            if any(r.exitcode() is None for r in absent):
                raise JobFailed(_absent_text(config, absent) + _stacks_text(config, ranks, run_dir), absent[0].rank)
            silent = {
                rank: s
                for rank, s in watch.silent(config.step_timeout).items()
                if rank < len(codes) and codes[rank] is None
            }
            if silent:
                rank = max(silent, key=silent.__getitem__)
                if restarts is not None and _replaced_silent(ranks, rank, silent[rank], restarts, watch):
                    continue
                if losses is not None and rank < config.servers:
                    _kill(ranks[rank])
                    losses.take(ranks, rank, _silent_how(config, silent[rank]), watch)
                    continue
                quitters = _quitters(config, ranks, watch, store)
                if quitters:  # silent in torch's teardown
                    raise JobFailed(_quit_text(config, quitters[0]), quitters[0].rank)
                raise JobFailed(
                    _silent_text(config, ranks[rank], silent[rank]) + _stacks_text(config, ranks, run_dir), rank
                )
            if deadline is not None and time.monotonic() > deadline:
                running = [config.role(r.rank) for r, c in zip(ranks, codes) if c is None]
                raise JobFailed(
                    f"job timed out after {timeout:.0f} s; still running: {', '.join(running)}"
                    + _stacks_text(config, ranks, run_dir)
                )
            stalled = watch.stalled(config.stall_report)
            if stalled and (reported is None or any(watch.places[r] != reported[r] for r in stalled)):
                reported = list(watch.places)
                print(
                    f"gradsync: {_stalled_text(config, stalled)}{_stacks_text(config, ranks, run_dir)}",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(POLL_S)  # its own loop, not wait_until: each look reads heartbeats, departures and stalls,
            # and its end is either outcome (every rank done, or a JobFailed that names the cause)
    except JobFailed:
        raise
    except BaseException:  # stopped by a signal (Ctrl-C, SIGTERM): where each rank was, before they are killed
        print(
            f"gradsync: stopping the job; where each rank was:{_stacks_text(config, ranks, run_dir)}",
            file=sys.stderr,
            flush=True,
        )
        raise


def _quitter_seen(
    config: JobConfig, ranks: list[RankProcess], codes: list, watch: Watch, store: dist.Store, exited: set[int]
) -> RankProcess | None:
    """A worker of a sync job with servers seen exiting 0 without gradsync.shutdown() since the last look (the
    servers wait for every worker's leave, so the job fails now, not once their wait times out); None when none. A
    worker that left wrote so before it exited, which a read of the store after its exit sees."""
    new = {r for r in range(config.servers, len(codes)) if codes[r] == 0} - exited
    if config.elastic or not config.servers or not new:
        return None
    exited |= new
    watch.read(store)
    return next((q for q in _quitters(config, ranks, watch, store) if q.rank in new), None)


def _replaced_silent(ranks: list[RankProcess], rank: int, seconds: float, restarts: Restarts, watch: Watch) -> bool:
    """Kill the silent worker of `rank` and replace it, when the job's policy allows (`Restarts.take`)."""
    if not restarts.allows(rank):
        return False
    _kill(ranks[rank])
    return restarts.take(ranks, rank, _silent_how(restarts.config, seconds), watch)


def _kill(rank: RankProcess) -> None:
    rank.kill(signal.SIGKILL)
    _let_exit([rank], _REAP_S, f"rank {rank.rank} to end on SIGKILL")


def _silent_how(config: JobConfig, seconds: float) -> str:
    """How a rank the launcher killed for its silence died."""
    return (
        f"stopped responding (no heartbeat for {seconds:.1f} s, step_timeout {config.step_timeout:g} s) and was killed"
    )


def _stalled_text(config: JobConfig, stalled: dict[int, float]) -> str:
    """Why the launcher shows every rank's stack while the job goes on: `stalled` workers' main threads wait."""
    waits = ", ".join(f"rank {rank} ({config.role(rank)}) for {seconds:.0f} s" for rank, seconds in stalled.items())
    return (
        f"no progress: the main thread has stayed at the same place in {waits} (stall_report "
        f"{config.stall_report:g} s: --stall-report or GRADSYNC_STALL_REPORT); the job goes on; each rank's "
        "stack:"
    )


def _stacks_text(config: JobConfig, ranks: list[RankProcess], run_dir: str) -> str:
    """Every running rank's Python stack, asked now (`rank_reports.ask_stacks`), each headed with the rank's name;
    '' when none runs."""
    running = [r for r in ranks if r.exitcode() is None]
    stacks = ask_stacks(
        {f"{config.role(r.rank)} (rank {r.rank})": (r.proc.pid, stack_file(run_dir, r.rank)) for r in running}
    )
    text = "".join(
        f"\n{name} stack:\n{text.rstrip()}"
        if text
        else f"\n{name}: no stack (not yet in gradsync.init(), or its process is stopped)"
        for name, text in stacks.items()
    )
    held: dict[str, list[str]] = {}  # what ranks still short of gradsync.init() wrote to stderr, each text once
    for r in running:
        said = early_stderr(early_stderr_file(run_dir, r.rank))
        if said:
            held.setdefault(said, []).append(f"{config.role(r.rank)} (rank {r.rank})")
    return text + "".join(
        f"\n{', '.join(names)} wrote before gradsync.init():\n{said.rstrip()}" for said, names in held.items()
    )


def _show_held_stderr(ranks: list[RankProcess], run_dir: str) -> None:
    """Write what ranks that exited without reaching gradsync.init() held of their stderr (`rank_reports`), each
    text once."""
    held = dict.fromkeys(early_stderr(early_stderr_file(run_dir, r.rank)) for r in ranks)
    for text in [t for t in held if t]:
        sys.stderr.write(text)
    sys.stderr.flush()
