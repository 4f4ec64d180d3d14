"""The `gradsync run` command's launchers: `run_script` starts a job's ranks as `python SCRIPT ARGS` would run
(forked from a fork server that imported torch once, `launcher.forked`, or each a new process: GRADSYNC_RANK_START)
and supervises them; `join_script` starts workers that join a running async ps job
(`gradsync run --join`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.errors import JobFailed
from gradsync.core.job_names import StoreKeys
from gradsync.core.settings import (
    EARLY_STDERR,
    ERROR_FILE,
    JOIN,
    JOIN_INDEX_FILE,
    LAUNCHER_PID,
    RANK_START,
    RUN_DIR,
    STDERR_FD,
    Setting,
)
from gradsync.core.waiting import wait_until
from gradsync.launcher import forked, netem
from gradsync.launcher.local_job import (
    hold_run_dir,
    job_config,
    network_and_store,
    offer_join,
    rank_environments,
    temporary_run_dir,
)
from gradsync.launcher.restarts import replacement_environment, restarting
from gradsync.launcher.script_file import check_script
from gradsync.launcher.supervision import RankProcess, kill_all, supervise
from gradsync.membership import newcomers
from gradsync.membership.departures import Departure
from gradsync.membership.launcher_death import dying_with_this_process
from gradsync.membership.member_keys import parse_gone, parse_left, record_gone
from gradsync.membership.rank_reports import error_file, recorded_error

_JOIN_STORE_TIMEOUT_S = 30.0


def run_script(
    script: str,
    script_args: list[str],
    *,
    strategy: str,
    workers: int,
    servers: int | None = None,
    mode: str | None = None,
    master_port: int = 0,
    run_dir: str | None = None,
    timeout: float | None = None,
    link: str | None = None,
    server_link: str | None = None,
    announce: bool = False,
    environment: dict[Setting, str] | None = None,
    started: Callable[[list[RankProcess]], None] | None = None,
    cwd: str | None = None,
    **settings,
) -> list[Departure]:
    """Run `python script args` on every rank (the `gradsync run` command); returns the workers that left an
    elastic job without finishing (`departures`). Raises JobFailed.

    run_dir: the job's files (default: GRADSYNC_RUN_DIR, else a new temporary directory, removed at the end),
    this job's alone while it runs (`local_job.hold_run_dir`).
    link: a tc rate (100mbit, 1gbit...): each rank in its own network namespace behind a link of that rate
    (`gradsync.launcher.netem`; root and iproute2), the store in the hub namespace; None: every rank on loopback.
    server_link: the parameter servers' links at this rate instead (with `link`): a slow server link.
    announce: say on stderr where the run directory is and how to reach or join the job (`gradsync run`
    does; `gradsync compare`, whose runs no one reaches, does not).
    environment: more variables for every rank (`gradsync compare`'s log directories and straggler), given to
    the ranks only.
    cwd: the ranks' working directory (`gradsync compare` gives each run its own); None: this process's.
    Other settings left None come from the GRADSYNC_* environment, else their defaults.
    """
    config = job_config("run_script", strategy, workers, servers, mode, **settings)
    return restarting(
        config,
        lambda config, restarts: _run_once(
            config,
            script,
            script_args,
            master_port,
            run_dir,
            timeout,
            link,
            server_link,
            announce,
            environment,
            started,
            cwd,
            restarts,
        ),
    )


def _run_once(
    config: JobConfig,
    script: str,
    script_args: list[str],
    master_port: int,
    run_dir: str | None,
    timeout: float | None,
    link: str | None,
    server_link: str | None,
    announce: bool,
    environment: dict[Setting, str] | None,
    started: Callable[[list[RankProcess]], None] | None,
    cwd: str | None,
    restarts: int,
) -> list[Departure]:
    """One run of the job `run_script` starts (its arguments; the `restarts`-th restart of the whole job): its
    ranks, supervised."""
    context = _rank_context()
    extra = {setting.env: value for setting, value in (environment or {}).items()}
    say = (lambda text: print(f"gradsync: {text}", file=sys.stderr, flush=True)) if announce else (lambda text: None)
    with contextlib.ExitStack() as stack:
        network, store = network_and_store(stack, config, master_port, link, server_link)
        check_script(script)
        if run_dir or RUN_DIR.read():
            run_dir = os.path.abspath(run_dir or RUN_DIR.read())
            hold_run_dir(stack, run_dir)
        else:
            run_dir = temporary_run_dir(stack, "gradsync-run-")
        say(f"run dir {run_dir}")
        if network is not None:
            behind = "" if server_link is None else f" (servers behind {server_link})"
            say(
                f"ranks behind {link} links{behind}; `ip netns exec {network.hub} gradsync status {run_dir}` "
                "reaches the job"
            )
        if offer_join(config, run_dir, store, network):
            say(f"more workers can join: gradsync run --join {run_dir} {script}")
        environments = rank_environments(config, store.port, run_dir, network, restarts)
        ranks: list[RankProcess] = []

        def start(rank: int, more: dict[str, str]) -> RankProcess:
            env = {**os.environ, **extra, **environments[rank], **more, **({"PWD": cwd} if cwd else {})}
            return RankProcess(rank, _start(context, rank, env, script, script_args, network, cwd), group=True)

        try:
            ranks.extend(start(rank, {}) for rank in range(config.world_size))
            if started is not None:
                started(ranks)
            return supervise(
                config, ranks, run_dir, store, timeout, lambda rank, n: start(rank, replacement_environment(n))
            )
        finally:
            kill_all(ranks)


def _rank_context():
    """The multiprocessing context that forks ranks from the fork server (`forked.rank_starter`), or None when
    GRADSYNC_RANK_START says each rank is a new process."""
    return forked.rank_starter()[0] if RANK_START.read() == "fork" else None


def _start(
    context,
    rank: int,
    env: dict[str, str],
    script: str,
    script_args: list[str],
    network: netem.Network | None,
    cwd: str | None = None,
):
    """The process of rank (or joiner) `rank`, running `python script script_args` in a session of its own with
    environment `env` (in its network namespace behind a link) in working directory `cwd` (None: this
    process's): forked from `context` (`forked.run_script`), or, without one, a new process."""
    if context is not None:
        args = (env, script, script_args, network.namespaces[rank] if network else None)
        proc = context.Process(
            target=forked.run_script if cwd is None else _run_in,
            daemon=False,
            args=args if cwd is None else (cwd, *args),
        )
        proc.start()
        return proc
    argv = [sys.executable, script, *script_args]
    if network is not None:
        argv = network.command(rank, argv)
    if not env.get(EARLY_STDERR.env):
        return subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True, preexec_fn=dying_with_this_process())
    launchers = os.dup(2)  # the rank's stderr until gradsync.init(): `rank_reports`
    try:
        with open(env[EARLY_STDERR.env], "wb") as held:
            return subprocess.Popen(
                argv,
                env={**env, STDERR_FD.env: str(launchers)},
                stderr=held,
                cwd=cwd,
                pass_fds=(launchers,),
                start_new_session=True,
                preexec_fn=dying_with_this_process(),
            )
    finally:
        os.close(launchers)


def _run_in(cwd: str, *args) -> None:
    """`forked.run_script(*args)` in working directory `cwd` (a forked rank has the fork server's)."""
    os.chdir(cwd)
    forked.run_script(*args)


def join_script(
    target: str, script: str, script_args: list[str], *, workers: int = 1, timeout: float | None = None
) -> None:
    """Start `workers` processes running `python script args` (forked, as `run_script`'s ranks) that join the
    running async ps job at `target` (its run directory, or its store's HOST:PORT), each as a new worker with the
    job's settings: the `gradsync run --join` command. A joined worker that dies or fails is recorded gone, and
    the job goes on.

    Raises:
        ConnectionError: the job's store cannot be reached.
        ConfigError: the job takes no joining workers (not an async ps job over torch RPC).
        JobFailed: a joined worker did not finish (killed, failed, or out of `timeout` seconds), with its
            traceback.
    """
    context = _rank_context()
    store, host, port = newcomers.connect(target, _JOIN_STORE_TIMEOUT_S)
    newcomers.job_settings(store, host, port, _JOIN_STORE_TIMEOUT_S)  # refuses a job that takes no newcomers
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="gradsync-join-") as files:
        joiners: list[RankProcess] = []
        failures: list[str] = []
        try:
            for i in range(workers):
                env = {
                    **os.environ,
                    JOIN.env: f"{host}:{port}",
                    LAUNCHER_PID.env: str(os.getpid()),
                    JOIN_INDEX_FILE.env: os.path.join(files, f"index-{i}"),
                    ERROR_FILE.env: error_file(files, i),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                }
                joiners.append(RankProcess(i, _start(context, i, env, script, script_args, None), group=True))
            running = list(joiners)

            def all_ended() -> bool:
                for joiner in [j for j in running if j.exitcode() is not None]:
                    running.remove(joiner)
                    failures.extend(_joiner_ended(joiner, files, store, f"exited with code {joiner.exitcode()}"))
                return not running

            with contextlib.suppress(TimeoutError):  # the joined workers still running are named below
                wait_until(all_ended, deadline, "the joined workers to finish")
            for joiner in running:
                failures += _joiner_ended(joiner, files, store, f"still running after {timeout:.0f} s (--timeout)")
        finally:
            kill_all(joiners)
            for joiner in joiners:  # stopped by a signal to this launcher: the job must not wait for them
                _joiner_ended(joiner, files, store, "stopped with gradsync run --join")
    if failures:
        raise JobFailed("\n".join(failures))


def _joiner_ended(joiner: RankProcess, files: str, store: dist.Store, how: str) -> list[str]:
    """Record joined worker `joiner` gone (`how`), unless it left the job (gradsync.shutdown) or was recorded
    already; returns what to report: [] when it left, else its failure with its traceback."""
    path = os.path.join(files, f"index-{joiner.rank}")
    code = joiner.exitcode()
    if code is not None and code < 0:
        how = f"killed by {signal.Signals(-code).name}"
    if not os.path.exists(path):
        text = f"joining worker {joiner.rank} {how} before it joined the job"
        return [] if code == 0 else [_with_traceback(text, files, joiner.rank)]
    worker, left = newcomers.read_index_file(path)
    if code == 0 and left:  # it left with gradsync.shutdown(): no failure, even once the job and its store are gone
        return []
    if code == 0:
        how = "exited without calling gradsync.shutdown()"
    try:
        if worker in parse_left(store.get(StoreKeys.LEFT)) or worker in parse_gone(store.get(StoreKeys.GONE)):
            return (
                []
                if code in (0, None)
                else [_with_traceback(f"worker{worker} (joined) left the job, then {how}", files, joiner.rank)]
            )
        record_gone(store, worker, how)
        text = f"worker{worker} (joined) left the job: {how}; the job goes on without it"
    except dist.DistError:
        text = f"worker{worker} (joined) {how}, and the job's store is gone: the job has ended"
    return [_with_traceback(text, files, joiner.rank)]


def _with_traceback(text: str, files: str, joiner: int) -> str:
    """`text`, and the traceback the joining process `joiner` recorded, if any."""
    recorded = recorded_error(files, joiner)
    return text if recorded is None else text + ":\n" + recorded
