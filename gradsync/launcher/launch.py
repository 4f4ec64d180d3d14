"""Local spawning for `gradsync run` and `gradsync.launch`: S servers + W workers on this machine.

The launcher hosts the rendezvous store itself (on loopback only, on a free
port unless one is given), gives each rank the environment torchrun would
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) plus gradsync's own,
and supervises: it watches exit codes and every rank's heartbeat (`liveness`),
and when a rank fails or falls silent for step_timeout, it kills every rank
and raises (or prints) the failure, naming the rank that caused it (one killed
by a signal, then one that is stopped or silent, then the first to record a
failure) with its traceback. Ranks die with the launcher, whatever kills it.
In an elastic job (async or ssp ps) a worker that dies is a departure, not a failure (`departures`), and
the launcher of an async job over torch RPC leaves `join.json` in the run directory for workers that join
it (`gradsync run --join`).
With a link rate (`--link`, `launcher.netem`) each rank runs in its own network namespace behind a shaped
link, and the store listens in the hub namespace of that network instead of on loopback.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing import forkserver

import torch
import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, StoreKeys, job_keywords, settings_from_env
from gradsync.core.emulated_network import HUB_ADDRESS
from gradsync.core.settings import (ERROR_FILE, JOIN, JOIN_INDEX_FILE, LAUNCHED, LAUNCHER_PID, RUN_DIR, STORE_IS_HOSTED,
                                    TOKEN)
from gradsync.core.torch_internals import forkserver_pid
from gradsync.launcher import netem, procfs
from gradsync.launcher.leases import Lease, abandoned
from gradsync.membership import newcomers
from gradsync.membership.departures import Departure, Departures, Results
from gradsync.membership.liveness import (Watch, create_keys, die_with_launcher, dying_with_this_process, interval,
                                          parse_gone, parse_left, parse_workers, ranks_named, record_gone)
from gradsync.proto.endpoints import new_token
from gradsync.runtime import cluster
from gradsync.runtime.failures import record_failure, say_failure
from gradsync.runtime.leaving import shutdown
from gradsync.runtime.start import init
from gradsync.runtime import store as rendezvous

_HOST = "127.0.0.1"
_POLL_S = 0.05
_KILL_GRACE_S = 3.0
_EXIT_GRACE_S = 10.0  # for a rank that recorded a failure to exit: torch's teardown takes seconds on a busy machine
_JOIN_STORE_TIMEOUT_S = 30.0
_PORT_FIX = "pass --master-port 0 (the default) to pick a free one, or choose another port"
_STATES = {
    "T": "its process is stopped (SIGSTOP, SIGTSTP)",
    "t": "its process is stopped by a debugger",
    "D": "its process waits in uninterruptible I/O",
}


class JobFailed(RuntimeError):
    """A rank of a launched job failed; the message names it and holds its traceback."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def host_store(port: int) -> dist.TCPStore:
    """Host the job's rendezvous store, listening on loopback only; port 0 picks a free one."""
    return rendezvous.host_store(_HOST, port, 60.0, _PORT_FIX)


PRELOADED = ("torch", "torch._dynamo", "gradsync.runtime.start", "gradsync.worker.ps_strategy",
             "gradsync.worker.allreduce_strategy", "gradsync.worker.hybrid_strategy", "gradsync.ps.server")
"""What the fork server imports once for every rank `launch` starts: a spawned rank spent ~2 s importing
torch, and ~1.5 s more importing torch._dynamo on its first optimizer or DDP (torch imports it there)."""


def rank_starter() -> tuple[multiprocessing.context.BaseContext, int]:
    """The multiprocessing context that starts `launch`'s ranks (a fork server with `PRELOADED` imported,
    shared by every launch of this process), and the pid of the ranks' parent (the fork server)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    forkserver.ensure_running()
    return context, forkserver_pid()


def rank_environments(config: JobConfig, port: int, run_dir: str, parent: int | None = None,
                      network: netem.Network | None = None) -> list[dict[str, str]]:
    """The environment of each rank: torchrun's variables plus GRADSYNC_*. `parent`: the pid of the process
    that starts the ranks, which they die with (default: this one); `network`: the job's emulated network,
    whose hub holds the store (default: every rank on loopback)."""
    base = dict(config.to_env())
    base.update(
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.world_size),
        TP_SOCKET_IFNAME="lo",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        # torch's C++ log lines (a TensorPipe EOF per worker that leaves an async job, c10d's "hostname of the
        # client socket cannot be retrieved" behind --link) tell a user nothing to do; TORCH_CPP_LOG_LEVEL=INFO
        # shows them. A rank `launch` forks has loaded torch already: its lines stay.
        TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    )
    base.update({STORE_IS_HOSTED.env: "1", RUN_DIR.env: run_dir,
                 TOKEN.env: TOKEN.read() or new_token(),
                 LAUNCHER_PID.env: str(parent or os.getpid())})
    envs = []
    for rank in range(config.world_size):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), **(network.environment(rank) if network else {}))
        env[ERROR_FILE.env] = os.path.join(run_dir, f"error-{rank}.txt")
        envs.append(env)
    return envs


class _Rank:
    """One child process, started either as a script (subprocess) or a function (multiprocessing)."""

    def __init__(self, rank: int, proc):
        self.rank = rank
        self.proc = proc
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
            if isinstance(self.proc, subprocess.Popen):
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def _kill_all(ranks: list[_Rank]) -> None:
    """SIGTERM every rank (and SIGCONT, so a stopped one handles it), SIGKILL those left after a grace period."""
    for r in ranks:
        r.kill(signal.SIGTERM)
        r.kill(signal.SIGCONT)
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


def _failure_text(config: JobConfig, run_dir: str, rank: int, code: int, arrived: bool = True,
                  recorded: str | None = None) -> str:
    """A failed rank's headline with the failure it recorded (`recorded`: the job's first failure in the store,
    which may be another rank's text that blames this one); `arrived`: whether it reached gradsync.init()."""
    how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    text = f"rank {rank} ({config.role(rank)}) failed with {how}"
    if recorded is not None:
        return text + ":\n" + recorded
    path = os.path.join(run_dir, f"error-{rank}.txt")
    if os.path.exists(path):
        with open(path) as f:
            return text + ":\n" + f.read()
    if not arrived:
        text += (" before it reached gradsync.init() (its traceback is above): every script that gradsync runs must "
                 "call gradsync.init() first, and nothing that starts torch.distributed itself (a DDP script's "
                 "dist.init_process_group fails on the port of gradsync's store: EADDRINUSE)")
    return text


def _absent_text(config: JobConfig, ranks: list[_Rank]) -> str:
    """Why the job stopped: `ranks` have not reached gradsync.init() within startup_timeout of their start."""
    exited = [r.rank for r in ranks if r.exitcode() == 0]
    text = (f"{ranks_named(config, [r.rank for r in ranks])} did not reach gradsync.init() within startup_timeout "
            f"({config.startup_timeout:.0f} s) of its start, and the other ranks wait for every one")
    if exited:
        text += f" ({ranks_named(config, exited)} exited with code 0 without calling it)"
    return text + ": is the script stuck before gradsync.init(), or does it skip it on some ranks?"


def _quit_text(config: JobConfig, rank: _Rank) -> str:
    """Why worker `rank` stopped the job: it exited without gradsync.shutdown() while the others trained."""
    code = rank.exitcode()
    how = ("its process hangs in torch's teardown" if code is None else f"code {code}" if code >= 0
           else f"then torch's teardown ended it with {signal.Signals(-code).name}")
    return (f"rank {rank.rank} ({config.role(rank.rank)}) exited ({how}) without gradsync.shutdown() while the "
            "others were training, so they failed waiting for it: every worker must call gradsync.shutdown() when "
            "it is done (for uneven data, train inside `with trainer.join():` on every worker, then call it)")


def _quitters(config: JobConfig, ranks: list[_Rank], watch: Watch, store: dist.Store) -> list[_Rank]:
    """Workers of a job that is not elastic that reached gradsync.init() and ended without leaving the job
    (gradsync.shutdown): exited 0, or noted at their interpreter's exit (`runtime.start`; torch's teardown may then
    abort or hang them), as of the watch's last read."""
    if config.elastic:
        return []
    exited = parse_workers(store.get(StoreKeys.EXITED))
    return [r for r in ranks[config.servers:] if watch.moved[r.rank] is not None
            and r.rank - config.servers not in watch.left
            and (r.exitcode() == 0 or r.rank - config.servers in exited)]


def _silent_text(config: JobConfig, rank: _Rank, seconds: float) -> str:
    """Why running `rank` stopped the job: it stopped sending heartbeats."""
    state = _STATES.get(rank.state(), "its process runs, but not its heartbeat thread (a C call holding the GIL?)")
    return (f"rank {rank.rank} ({config.role(rank.rank)}) stopped responding: no heartbeat for {seconds:.1f} s "
            f"(step_timeout {config.step_timeout:.0f} s); {state}")


def _recorded_failure(ranks: list[_Rank], store: dist.Store) -> tuple[int, str] | None:
    """The rank the job's first failure in the store is recorded under (the rank that recorded it, or the
    worker its text blames) and its text, once that rank has exited non-zero (given a few seconds to)."""
    if not store.check([StoreKeys.FAILED]):
        return None
    head, text = store.get(StoreKeys.FAILED).decode().split(":", 1)
    first = ranks[int(head.split()[1])]
    deadline = time.monotonic() + _EXIT_GRACE_S
    while first.exitcode() is None and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return (first.rank, text.lstrip()) if first.exitcode() not in (None, 0) else None


def _absent(config: JobConfig, ranks: list[_Rank], watch: Watch, departed: set[int]) -> list[_Rank]:
    """Ranks that have not reached gradsync.init() (running, or exited 0) within startup_timeout of their start."""
    now = time.monotonic()
    return [r for r in ranks if r.rank not in departed and watch.moved[r.rank] is None and r.exitcode() in (None, 0)
            and now - r.started >= config.startup_timeout]


def _root_cause(config: JobConfig, ranks: list[_Rank], watch: Watch, store: dist.Store, run_dir: str,
                departed: set[int]) -> JobFailed:
    """The failure that explains the others: a worker that ended without gradsync.shutdown() in a job that is
    not elastic; else a rank killed by a signal without recording a failure (it could
    not report); else ranks that never reached gradsync.init() within startup_timeout, workers that never
    built their Trainer, or a running rank that is stopped or silent for half the step timeout (the others
    failed waiting for them); else the first to record a failure; else the lowest failed rank.
    Ranks in `departed` (workers that left an elastic job) are none of these."""
    failed = [(r.rank, r.exitcode()) for r in ranks if r.exitcode() not in (None, 0) and r.rank not in departed]
    quitters = _quitters(config, ranks, watch, store)
    if quitters:
        followers = [rank for rank, _ in failed if rank != quitters[0].rank]
        then = "" if not followers else "\nthen " + _failure_text(config, run_dir, followers[0],
                                                                 ranks[followers[0]].exitcode())
        return JobFailed(_quit_text(config, quitters[0]) + then, quitters[0].rank)
    for rank, code in failed:
        if code < 0 and not os.path.exists(os.path.join(run_dir, f"error-{rank}.txt")):
            return JobFailed(_failure_text(config, run_dir, rank, code, watch.moved[rank] is not None), rank)
    recorded = _recorded_failure(ranks, store)
    follower = recorded[0] if recorded is not None else failed[0][0]
    follower_text = _failure_text(config, run_dir, follower, ranks[follower].exitcode(),
                                  watch.moved[follower] is not None, recorded and recorded[1])
    absent = _absent(config, ranks, watch, departed)
    if absent:
        return JobFailed(f"{_absent_text(config, absent)}\nthen {follower_text}", absent[0].rank)
    late = watch.without_trainer(min(config.startup_timeout, config.step_timeout) / 2)
    late = [w for w in late if ranks[config.servers + w].exitcode() in (None, 0)]
    if late:
        return JobFailed(f"{watch.describe_without_trainer(late)}\nthen {follower_text}", config.servers + late[0])
    silent = watch.silent(config.step_timeout / 2)
    suspects = [r for r in ranks if r.rank != follower and r.rank not in departed
                and (r.rank in silent or r.state() in ("T", "t"))
                and r.exitcode() is None]
    if suspects:
        cause = max(suspects, key=lambda r: silent.get(r.rank, 0.0))
        return JobFailed(f"{_silent_text(config, cause, silent.get(cause.rank, 0.0))}\nthen {follower_text}",
                         cause.rank)
    return JobFailed(follower_text, follower)


def supervise(config: JobConfig, ranks: list[_Rank], run_dir: str, store: dist.Store, timeout: float | None
              ) -> list[Departure]:
    """Wait until every rank has exited 0, or, in an elastic job, departed (`departures`); returns the
    departures. Raises JobFailed when one fails (naming the root cause), when every worker of an elastic job
    has departed, when a running rank has not reached gradsync.init() within startup_timeout of its start or
    has sent no heartbeat for step_timeout, or after `timeout` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    watch = Watch(config)
    departures = Departures(config, store, run_dir) if config.elastic else None
    next_read = 0.0
    while True:
        codes = [r.exitcode() for r in ranks]
        if departures is not None and departures.observe(codes):
            raise JobFailed(f"every worker left the job, so it cannot finish: {departures.describe()}",
                            min(departures.found))
        departed = set(departures.found) if departures is not None else set()
        if all(c == 0 or rank in departed for rank, c in enumerate(codes)):
            return departures.report() if departures is not None else []
        failed = any(c not in (None, 0) and rank not in departed for rank, c in enumerate(codes))
        if failed or time.monotonic() >= next_read:
            watch.read(store)
            next_read = time.monotonic() + interval(config.step_timeout)
        if failed:
            raise _root_cause(config, ranks, watch, store, run_dir, departed)
        absent = _absent(config, ranks, watch, departed)
        if any(r.exitcode() is None for r in absent):
            raise JobFailed(_absent_text(config, absent), absent[0].rank)
        silent = {rank: s for rank, s in watch.silent(config.step_timeout).items()
                  if rank < len(codes) and codes[rank] is None}
        if silent:
            rank = max(silent, key=silent.get)
            quitters = _quitters(config, ranks, watch, store)
            if quitters:  # silent in torch's teardown
                raise JobFailed(_quit_text(config, quitters[0]), quitters[0].rank)
            raise JobFailed(_silent_text(config, ranks[rank], silent[rank]), rank)
        if deadline is not None and time.monotonic() > deadline:
            running = [config.role(r.rank) for r, c in zip(ranks, codes) if c is None]
            raise JobFailed(f"job timed out after {timeout:.0f} s; still running: {', '.join(running)}")
        time.sleep(_POLL_S)


def _job_config(call, strategy, workers, servers, mode, **chosen) -> JobConfig:
    """The job's settings: the arguments that are not None, else the GRADSYNC_* environment, else the defaults."""
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}")
    values = settings_from_env(os.environ, strategy)
    values.update({k: v for k, v in dict(mode=mode, servers=servers, **job_keywords(chosen, call)).items()
                   if v is not None})
    return JobConfig(world_size=values["servers"] + workers, **values)


_RUN_DIRS = ("gradsync-run-", "gradsync-launch-")
_RUN_DIR_LEASE = ".lease"


def temporary_run_dir(stack: contextlib.ExitStack, prefix: str) -> str:
    """A new temporary run directory, removed when `stack` closes. It holds a lease (`gradsync.launcher.leases`):
    first, the temporary run directories of launchers that died (SIGKILL) are removed here."""
    for old in glob.glob(os.path.join(tempfile.gettempdir(), "gradsync-*-*", _RUN_DIR_LEASE)):
        if os.path.basename(os.path.dirname(old)).startswith(_RUN_DIRS) and abandoned(old):
            shutil.rmtree(os.path.dirname(old), ignore_errors=True)
    path = tempfile.mkdtemp(prefix=prefix)
    stack.callback(Lease(os.path.join(path, _RUN_DIR_LEASE)).release)
    stack.callback(shutil.rmtree, path, ignore_errors=True)
    return path


def _network_and_store(stack: contextlib.ExitStack, config: JobConfig, port: int, link: str | None,
                       server_link: str | None) -> tuple[netem.Network | None, dist.TCPStore]:
    """The job's emulated network (removed when `stack` closes) when `link` names a rate, else None; and its
    store, with every rank's heartbeat key: in the network's hub namespace, else on loopback. `server_link`:
    the servers' rate, when it differs from `link`."""
    if server_link is not None and link is None:
        raise ConfigError(f"--server-link {server_link} needs --link too, the rate of the workers' links: "
                          f"e.g. --link 1gbit --server-link {server_link}")
    network = None
    if link is None:
        store = host_store(port)
    else:
        slow = None if server_link is None else netem.Link.parse(server_link, "--server-link")
        network = stack.enter_context(netem.Network(netem.Link.parse(link), config.world_size, slow, config.servers))
        store = network.in_hub(lambda: rendezvous.host_store(HUB_ADDRESS, port, 60.0, _PORT_FIX))
    create_keys(store, config.world_size, config.num_workers)
    return network, store


def _offer_join(config: JobConfig, run_dir: str, store: dist.TCPStore, network: netem.Network | None) -> bool:
    """Leave join.json in the run directory when workers can join this job (async ps over torch RPC, on this
    machine's loopback); returns whether it did."""
    if not newcomers.joinable(config) or network is not None:
        return False
    newcomers.write_join_file(run_dir, _HOST, store.port)
    return True


def run_script(script: str, script_args: list[str], *, strategy: str, workers: int, servers: int | None = None,
               mode: str | None = None, master_port: int = 0, run_dir: str | None = None,
               timeout: float | None = None, link: str | None = None, server_link: str | None = None,
               announce: bool = False, **settings) -> list[Departure]:
    """Run `python script args` on every rank (the `gradsync run` command); returns the workers that left an
    elastic job without finishing (`departures`). Raises JobFailed.

    run_dir: the job's files (default: GRADSYNC_RUN_DIR, else a new temporary directory, removed at the end).
    link: a tc rate (100mbit, 1gbit...): each rank in its own network namespace behind a link of that rate
    (`gradsync.launcher.netem`; root and iproute2), the store in the hub namespace; None: every rank on loopback.
    server_link: the parameter servers' links at this rate instead (with `link`): a slow server link.
    announce: say on stderr where the run directory is and how to reach or join the job (`gradsync run`
    does; `gradsync compare`, whose runs no one reaches, does not).
    Other settings left None come from the GRADSYNC_* environment, else their defaults.
    """
    config = _job_config("run_script", strategy, workers, servers, mode, **settings)
    say = (lambda text: print(f"gradsync: {text}", file=sys.stderr, flush=True)) if announce else (lambda text: None)
    with contextlib.ExitStack() as stack:
        network, store = _network_and_store(stack, config, master_port, link, server_link)
        check_script(script)
        run_dir = os.path.abspath(run_dir or RUN_DIR.read() or temporary_run_dir(stack, "gradsync-run-"))
        os.makedirs(run_dir, exist_ok=True)
        for old in glob.glob(os.path.join(run_dir, "stats-*.json")):  # an earlier job's: this one has not ended
            os.remove(old)
        say(f"run dir {run_dir}")
        if network is not None:
            servers = "" if server_link is None else f" (servers behind {server_link})"
            say(f"ranks behind {link} links{servers}; `ip netns exec {network.hub} gradsync status {run_dir}` "
                "reaches the job")
        if _offer_join(config, run_dir, store, network):
            say(f"more workers can join: gradsync run --join {run_dir} {script}")
        ranks = []
        try:
            for rank, env in enumerate(rank_environments(config, store.port, run_dir, network=network)):
                argv = [sys.executable, script, *script_args]
                if network is not None:
                    argv = network.command(rank, argv)
                proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True,
                                        preexec_fn=dying_with_this_process())
                ranks.append(_Rank(rank, proc))
            return supervise(config, ranks, run_dir, store, timeout)
        finally:
            _kill_all(ranks)


def check_script(script: str) -> None:
    """Refuse a script path that names no file, before any rank starts (python would fail in every rank)."""
    if not os.path.isfile(script):
        raise ConfigError(f"{script}: no such file: give the path of the training script")


def _run_function(env: dict, call: bytes, result_path: str, namespace: str | None) -> None:
    """Body of a spawned rank: die with the launcher, enter its network namespace (if any), init, then fn(*args)
    (`call`, pickled by the launcher) on workers; a failure is recorded for the launcher."""
    os.environ.update({**env, LAUNCHED.env: "1"})
    try:
        die_with_launcher()
        if namespace is not None:
            netem.enter(namespace)
        fn, args = _unpickle_call(call)
        init()
        result = fn(*args)
        shutdown()
        torch.save(result, result_path)
    except BaseException:
        say_failure(record_failure(cluster.running(), int(env["RANK"]), traceback.format_exc()))
        os._exit(1)


def _unpickle_call(call: bytes):
    """(fn, args) as `launch` pickled them; the error of a function the rank cannot find says why."""
    try:
        return pickle.loads(call)
    except AttributeError as e:
        if "__main__" not in str(e) and "__mp_main__" not in str(e):
            raise
        raise AttributeError(
            f"{e}: gradsync.launch's function must be defined at the top level of its module, since each rank "
            "imports the main script again without running its `if __name__ == \"__main__\":` block (nor "
            "another function's body): move the function there, or into a module of its own") from e


def launch(fn, *, strategy: str, workers: int, servers: int | None = None, mode: str = "sync", args: tuple = (),
           timeout: float | None = None, link: str | None = None, server_link: str | None = None,
           **settings) -> Results:
    """Run `fn(*args)` on each worker of a local job and return the results in worker order.

    In an async or ssp ps job a worker that dies (killed, or exited without an exception and without
    gradsync.shutdown()) does not stop the job: its result is None, the returned list's `departures` says
    who left, when and at which step (also said on stderr), and the run directory (GRADSYNC_RUN_DIR on
    every rank) has the join.json that `gradsync run --join` takes.

    Args:
        fn: a picklable (module-level) function; it runs after `gradsync.init()` (a `gradsync.init()`
            call inside it joins this job, and so does a `gradsync.shutdown()`).
        strategy: 'ps', 'allreduce' or 'hybrid'; workers: W >= 1; servers: S (>= 1 for ps and hybrid, 0
            for allreduce; None: 1 for ps and hybrid, 0 for allreduce, as `gradsync run`).
        mode: 'sync', 'async' or 'ssp'.
        timeout: seconds for the whole job (None: no limit).
        link: a tc rate (100mbit, 1gbit...): each rank in its own network namespace behind a link of that
            rate (`gradsync.launcher.netem`; root and iproute2); None: every rank on loopback.
        server_link: the parameter servers' links at this rate instead (with `link`): a slow server link.
        settings: other JobConfig fields (nonfinite, compression, step_timeout, ...); those not given come
            from the GRADSYNC_* environment, else their defaults.
    Raises:
        JobFailed: naming the rank that caused the failure, with its traceback (or, in an async or ssp job,
            the departures when every worker left).
    """
    config = _job_config("gradsync.launch", strategy, workers, servers, mode, **settings)
    call = pickle.dumps((fn, args))  # here, so that an unpicklable function fails before any rank starts
    with contextlib.ExitStack() as stack:
        network, store = _network_and_store(stack, config, 0, link, server_link)
        run_dir = temporary_run_dir(stack, "gradsync-launch-")
        _offer_join(config, run_dir, store, network)
        context, parent = rank_starter()
        ranks = []
        try:
            for rank, env in enumerate(rank_environments(config, store.port, run_dir, parent, network)):
                result_path = os.path.join(run_dir, f"result-{rank}.pt")
                namespace = network.namespaces[rank] if network else None
                proc = context.Process(target=_run_function, args=(env, call, result_path, namespace),
                                       daemon=False)
                proc.start()
                ranks.append(_Rank(rank, proc))
            departures = supervise(config, ranks, run_dir, store, timeout)
            paths = [os.path.join(run_dir, f"result-{rank}.pt") for rank in range(config.servers, config.world_size)]
            # fn's return values, any picklable object, from the job's own ranks through a 0700 directory
            return Results([torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths],
                           departures)
        finally:
            _kill_all(ranks)


def join_script(target: str, script: str, script_args: list[str], *, workers: int = 1,
                timeout: float | None = None) -> None:
    """Start `workers` processes running `python script args` that join the running async ps job at `target`
    (its run directory, or its store's HOST:PORT), each as a new worker with the job's settings: the
    `gradsync run --join` command. A joined worker that dies or fails is recorded gone, and the job goes on.

    Raises:
        ConnectionError: the job's store cannot be reached.
        ConfigError: the job takes no joining workers (not an async ps job over torch RPC).
        JobFailed: a joined worker did not finish (killed, failed, or out of `timeout` seconds), with its
            traceback.
    """
    host, port = newcomers.store_address(target)
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=_JOIN_STORE_TIMEOUT_S))
    except dist.DistError as e:
        raise ConnectionError(f"cannot reach the store of the job to join at {host}:{port} (has it ended?): {e}") from e
    newcomers.job_settings(store, host, port, _JOIN_STORE_TIMEOUT_S)  # refuses a job that takes no newcomers
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="gradsync-join-") as files:
        joiners: list[_Rank] = []
        failures: list[str] = []
        try:
            for i in range(workers):
                env = {**os.environ, JOIN.env: f"{host}:{port}", LAUNCHER_PID.env: str(os.getpid()),
                       JOIN_INDEX_FILE.env: os.path.join(files, f"index-{i}"),
                       ERROR_FILE.env: os.path.join(files, f"error-{i}.txt"),
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                proc = subprocess.Popen([sys.executable, script, *script_args], env=env, start_new_session=True)
                joiners.append(_Rank(i, proc))
            running = list(joiners)
            while running and (deadline is None or time.monotonic() < deadline):
                for joiner in [j for j in running if j.exitcode() is not None]:
                    running.remove(joiner)
                    failures += _joiner_ended(joiner, files, store, f"exited with code {joiner.exitcode()}")
                time.sleep(_POLL_S)
            for joiner in running:
                failures += _joiner_ended(joiner, files, store, f"still running after {timeout:.0f} s (--timeout)")
        finally:
            _kill_all(joiners)
            for joiner in joiners:  # stopped by a signal to this launcher: the job must not wait for them
                _joiner_ended(joiner, files, store, "stopped with gradsync run --join")
    if failures:
        raise JobFailed("\n".join(failures))


def _joiner_ended(joiner: _Rank, files: str, store: dist.Store, how: str) -> list[str]:
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
            return [] if code in (0, None) else [_with_traceback(f"worker{worker} (joined) left the job, then {how}",
                                                                 files, joiner.rank)]
        record_gone(store, worker, how)
        text = f"worker{worker} (joined) left the job: {how}; the job goes on without it"
    except dist.DistError:
        text = f"worker{worker} (joined) {how}, and the job's store is gone: the job has ended"
    return [_with_traceback(text, files, joiner.rank)]


def _with_traceback(text: str, files: str, joiner: int) -> str:
    """`text`, and the traceback the joining process `joiner` recorded, if any."""
    path = os.path.join(files, f"error-{joiner}.txt")
    if os.path.exists(path):
        with open(path) as f:
            text += ":\n" + f.read()
    return text
