"""Local spawning for `gradsync run` and `gradsync.launch`: S servers + W workers on this machine.

The launcher hosts the rendezvous store itself (on a free port unless one is
given), gives each rank the environment torchrun would (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) plus gradsync's own, and supervises:
when any rank fails, every other rank is killed and the failing rank's
traceback is raised (or printed), so a job never hangs on a dead peer.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, StoreKeys, default_servers
from gradsync.proto.endpoints import new_token

_POLL_S = 0.05
_KILL_GRACE_S = 3.0


class JobFailed(RuntimeError):
    """A rank of a launched job failed; the message names it and holds its traceback."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def host_store(port: int) -> dist.TCPStore:
    """Host the job's rendezvous store on loopback; port 0 picks a free one."""
    try:
        return dist.TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
    except (RuntimeError, OSError) as e:
        if "in use" in str(e).lower():
            raise ConfigError(
                f"port {port} on 127.0.0.1 is already in use: pass --master-port 0 (the default) to pick a free "
                "one, or choose another port"
            ) from e
        raise


def rank_environments(config: JobConfig, port: int, run_dir: str) -> list[dict[str, str]]:
    """The environment of each rank: torchrun's variables plus GRADSYNC_*."""
    base = dict(config.to_env())
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.world_size),
        GRADSYNC_STORE_HOSTED="1",
        GRADSYNC_RUN_DIR=run_dir,
        GRADSYNC_TOKEN=os.environ.get("GRADSYNC_TOKEN") or new_token(),
        TP_SOCKET_IFNAME="lo",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    envs = []
    for rank in range(config.world_size):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        env["GRADSYNC_ERROR_FILE"] = os.path.join(run_dir, f"error-{rank}.txt")
        envs.append(env)
    return envs


def role(config: JobConfig, rank: int) -> str:
    return f"ps{rank}" if rank < config.servers else f"worker{rank - config.servers}"


class _Rank:
    """One child process, started either as a script (subprocess) or a function (multiprocessing)."""

    def __init__(self, rank: int, proc):
        self.rank = rank
        self.proc = proc

    def exitcode(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def kill(self, sig: int) -> None:
        if self.exitcode() is not None:
            return
        try:
            if isinstance(self.proc, subprocess.Popen):
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def _kill_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        r.kill(signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    while any(r.exitcode() is None for r in ranks) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for r in ranks:
        r.kill(signal.SIGKILL)
    for r in ranks:
        if isinstance(r.proc, subprocess.Popen):
            r.proc.wait(timeout=10)
        else:
            r.proc.join(timeout=10)


def _failure_text(config: JobConfig, run_dir: str, rank: int, code: int) -> str:
    how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    text = f"rank {rank} ({role(config, rank)}) failed with {how}"
    path = os.path.join(run_dir, f"error-{rank}.txt")
    if os.path.exists(path):
        with open(path) as f:
            text += ":\n" + f.read()
    return text


def _first_failure(ranks: list[_Rank], failed: list[tuple[int, int]], store: dist.Store) -> tuple[int, int]:
    """The root cause among failed ranks: one killed by a signal (it could not report), else the first
    to record its failure in the store (given a few seconds to exit by itself), else the lowest rank."""
    for rank, code in failed:
        if code < 0:
            return rank, code
    if store.check([StoreKeys.FAILED]):
        first = ranks[int(store.get(StoreKeys.FAILED).decode().split(":", 1)[0].split()[1])]
        deadline = time.monotonic() + _KILL_GRACE_S
        while first.exitcode() is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if first.exitcode() not in (None, 0):
            return first.rank, first.exitcode()
    return failed[0]


def supervise(config: JobConfig, ranks: list[_Rank], run_dir: str, store: dist.Store, timeout: float | None) -> None:
    """Wait for every rank; on the first failure (or the timeout) kill the rest and raise JobFailed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [r.exitcode() for r in ranks]
            failed = [(r.rank, c) for r, c in zip(ranks, codes) if c not in (None, 0)]
            if failed:
                rank, code = _first_failure(ranks, failed, store)
                raise JobFailed(_failure_text(config, run_dir, rank, code), rank)
            if all(c == 0 for c in codes):
                return
            if deadline is not None and time.monotonic() > deadline:
                running = [role(config, r.rank) for r, c in zip(ranks, codes) if c is None]
                raise JobFailed(f"job timed out after {timeout:.0f} s; still running: {', '.join(running)}")
            time.sleep(_POLL_S)
    finally:
        _kill_all(ranks)


def _job_config(strategy, workers, servers, mode, **settings) -> JobConfig:
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}")
    if servers is None:
        servers = default_servers(strategy)
    return JobConfig(strategy=strategy, mode=mode, servers=servers, world_size=servers + workers, **settings)


def run_script(script: str, script_args: list[str], *, strategy: str, workers: int, servers: int | None, mode: str,
               master_port: int = 0, run_dir: str | None = None, timeout: float | None = None,
               **settings) -> None:
    """Run `python script args` on every rank (the `gradsync run` command). Raises JobFailed."""
    config = _job_config(strategy, workers, servers, mode, **settings)
    store = host_store(master_port)
    run_dir = os.path.abspath(run_dir or tempfile.mkdtemp(prefix="gradsync-run-"))
    os.makedirs(run_dir, exist_ok=True)
    print(f"gradsync: run dir {run_dir}", file=sys.stderr, flush=True)
    ranks = []
    for rank, env in enumerate(rank_environments(config, store.port, run_dir)):
        proc = subprocess.Popen([sys.executable, script, *script_args], env={**os.environ, **env},
                                start_new_session=True)
        ranks.append(_Rank(rank, proc))
    supervise(config, ranks, run_dir, store, timeout)


def _run_function(env: dict, fn, args: tuple, result_path: str) -> None:
    """Body of a spawned rank: init, then fn on workers; a failure is recorded for the launcher."""
    os.environ.update(env, GRADSYNC_LAUNCHED="1")
    from gradsync import cluster

    try:
        cluster.init()
        result = fn(*args)
        cluster.shutdown()
        torch.save(result, result_path)
    except BaseException:
        store = cluster._STATE.store if cluster._STATE is not None else None
        cluster.record_failure(store, int(env["RANK"]), traceback.format_exc())
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


def launch(fn, *, strategy: str, workers: int, servers: int | None = None, mode: str = "sync", args: tuple = (),
           timeout: float | None = None, **settings) -> list:
    """Run `fn(*args)` on each worker of a local job and return the results in worker order.

    Args:
        fn: a picklable (module-level) function; it runs after `gradsync.init()` (a `gradsync.init()`
            call inside it joins this job, and so does a `gradsync.shutdown()`).
        strategy: 'ps', 'allreduce' or 'hybrid'; workers: W >= 1; servers: S (>= 1 for ps and hybrid, 0
            for allreduce; None: 1 for ps and hybrid, 0 for allreduce, as `gradsync run`).
        mode: 'sync' or 'async'.
        timeout: seconds for the whole job (None: no limit).
        settings: other JobConfig fields (nonfinite, compression, step_timeout, ...).
    Raises:
        JobFailed: naming the failing rank, with its traceback.
    """
    config = _job_config(strategy, workers, servers, mode, **settings)
    store = host_store(0)
    run_dir = tempfile.mkdtemp(prefix="gradsync-launch-")
    context = multiprocessing.get_context("spawn")
    ranks = []
    try:
        for rank, env in enumerate(rank_environments(config, store.port, run_dir)):
            result_path = os.path.join(run_dir, f"result-{rank}.pt")
            proc = context.Process(target=_run_function, args=(env, fn, args, result_path), daemon=False)
            proc.start()
            ranks.append(_Rank(rank, proc))
        supervise(config, ranks, run_dir, store, timeout)
        return [
            torch.load(os.path.join(run_dir, f"result-{rank}.pt"), weights_only=False)
            for rank in range(config.servers, config.world_size)
        ]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

