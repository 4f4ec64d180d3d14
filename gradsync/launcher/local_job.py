"""What a launcher on this machine prepares before it starts a job's ranks: the job's settings, its
rendezvous store (on loopback, or in the hub of an emulated network), its run directory, and each rank's
environment: the variables torchrun would set plus gradsync's own.

The launcher hosts the store itself (on loopback only, on a free port unless one is given). With a link rate
(`--link`, `launcher.netem`) each rank runs in its own network namespace behind a shaped link, and the store
listens in the hub namespace of that network instead, hosted from a thread of the launcher that entered it
(torch's C++ lines meanwhile at the ranks' level: `launcher.torch_logs`). The launcher of an async job over torch
RPC leaves `join.json` in the run directory for workers that join it (`gradsync run --join`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile

import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, job_keywords, settings_from_env
from gradsync.core.emulated_network import HUB_ADDRESS
from gradsync.core.settings import (
    EARLY_STDERR,
    ERROR_FILE,
    LAUNCHER_PID,
    LOCAL_RANK,
    MASTER_ADDR,
    MASTER_PORT,
    RANK,
    RESTART_COUNT,
    RUN_DIR,
    STACK_FILE,
    STORE_IS_HOSTED,
    TOKEN,
    WORLD_SIZE,
)
from gradsync.launcher import netem, torch_logs
from gradsync.launcher.leases import Lease, abandoned, holder
from gradsync.membership import newcomers
from gradsync.membership.member_keys import create_keys
from gradsync.membership.rank_reports import early_stderr_file, error_file, stack_file
from gradsync.runtime import store as rendezvous
from gradsync.transport.grpc.endpoint_files import job_id, new_token

HOST = "127.0.0.1"
"""Where a local job's store and ranks listen without an emulated network: loopback only."""
_PORT_FIX = "pass --master-port 0 (the default) to pick a free one, or choose another port"


def host_store(port: int) -> dist.TCPStore:
    """Host the job's rendezvous store, listening on loopback only; port 0 picks a free one."""
    return rendezvous.host_store(HOST, port, 60.0, _PORT_FIX)


def rank_environments(
    config: JobConfig, port: int, run_dir: str, network: netem.Network | None = None, restarts: int = 0
) -> list[dict[str, str]]:
    """The environment of each rank: torchrun's variables plus GRADSYNC_*, and this process's pid, which the
    ranks die with; `network`: the job's emulated network, whose hub holds the store (default: every rank on
    loopback); `restarts`: the whole job's restarts so far (TORCHELASTIC_RESTART_COUNT, as torchrun sets it)."""
    base = {
        **config.to_env(),
        MASTER_ADDR.env: HOST,
        MASTER_PORT.env: str(port),
        WORLD_SIZE.env: str(config.world_size),
        "LOCAL_WORLD_SIZE": str(config.world_size),  # torchrun's, which gradsync does not read
        "TP_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCH_CPP_LOG_LEVEL": torch_logs.level(),
        STORE_IS_HOSTED.env: "1",
        RUN_DIR.env: run_dir,
        TOKEN.env: TOKEN.read() or new_token(),
        LAUNCHER_PID.env: str(os.getpid()),
        RESTART_COUNT.env: str(restarts),
    }
    return [
        {
            **base,
            RANK.env: str(rank),
            LOCAL_RANK.env: str(rank),
            **(network.environment(rank) if network else {}),
            ERROR_FILE.env: error_file(run_dir, rank),
            STACK_FILE.env: stack_file(run_dir, rank),
            EARLY_STDERR.env: early_stderr_file(run_dir, rank),
        }
        for rank in range(config.world_size)
    ]


def job_config(call, strategy, workers, servers, mode, **chosen) -> JobConfig:
    """The job's settings: the arguments that are not None, else the GRADSYNC_* environment, else the defaults."""
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}")
    values = settings_from_env(os.environ, strategy)
    values.update(
        {k: v for k, v in dict(mode=mode, servers=servers, **job_keywords(chosen, call)).items() if v is not None}
    )
    return JobConfig(world_size=values["servers"] + workers, **values)


_RUN_DIRS = ("gradsync-run-", "gradsync-launch-")
_RUN_DIR_LEASE = ".lease"
_RANK_REPORTS = ("stack-*.txt*", "stderr-*.txt")
"""The files a job's ranks write for their launcher only (`rank_reports`): removed when the job ends."""
_EARLIER_JOB_FILES = ("stats-*.json", "grpc-*.json", "error-*.txt", newcomers.JOIN_FILE, *_RANK_REPORTS)
"""What a job that ended left in its run directory: its servers' final counters and endpoints, its ranks'
recorded failures, its join.json, and the rank reports of a launcher that was killed."""


def temporary_run_dir(stack: contextlib.ExitStack, prefix: str) -> str:
    """A new temporary run directory, removed when `stack` closes. It holds a lease (`gradsync.launcher.leases`):
    first, the temporary run directories of launchers that died (SIGKILL) are removed here."""
    for old in glob.glob(os.path.join(tempfile.gettempdir(), "gradsync-*-*", _RUN_DIR_LEASE)):
        if os.path.basename(os.path.dirname(old)).startswith(_RUN_DIRS) and abandoned(old):
            shutil.rmtree(os.path.dirname(old), ignore_errors=True)
    path = tempfile.mkdtemp(prefix=prefix)
    stack.callback(Lease(os.path.join(path, _RUN_DIR_LEASE), str(os.getpid()).encode()).release)
    stack.callback(shutil.rmtree, path, ignore_errors=True)
    return path


def hold_run_dir(stack: contextlib.ExitStack, run_dir: str) -> None:
    """Make `run_dir` (created if missing) this job's until `stack` closes: a lease naming this process, taken
    over from a launcher that died, and the files an earlier job left there removed.

    Raises:
        ConfigError: another job's launcher holds `run_dir`, naming its pid.
    """
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, _RUN_DIR_LEASE)
    try:
        lease = Lease(path, str(os.getpid()).encode(), take_abandoned=True)
    except FileExistsError:
        pid = holder(path).decode() or "that has just ended"
        raise ConfigError(
            f"{run_dir} is the run dir of a running job (its launcher is pid {pid}): give this job "
            f"another --run-dir, or wait for pid {pid} to end (or stop it)"
        ) from None
    stack.callback(lease.release)
    _remove(run_dir, _EARLIER_JOB_FILES)
    stack.callback(_remove, run_dir, _RANK_REPORTS)  # once the ranks are gone, before the lease


def _remove(run_dir: str, patterns: tuple[str, ...]) -> None:
    """Remove the files of `run_dir` that match `patterns`."""
    for pattern in patterns:
        for old in glob.glob(os.path.join(run_dir, pattern)):
            os.remove(old)


def network_and_store(
    stack: contextlib.ExitStack, config: JobConfig, port: int, link: str | None, server_link: str | None
) -> tuple[netem.Network | None, dist.TCPStore]:
    """The job's emulated network (removed when `stack` closes) when `link` names a rate, else None; and its
    store, with every rank's heartbeat key: in the network's hub namespace, else on loopback. `server_link`:
    the servers' rate, when it differs from `link`."""
    if server_link is not None and link is None:
        raise ConfigError(
            f"--server-link {server_link} needs --link too, the rate of the workers' links: "
            f"e.g. --link 1gbit --server-link {server_link}"
        )
    network = None
    if link is None:
        store = host_store(port)
    else:
        slow = None if server_link is None else netem.Link.parse(server_link, "--server-link")
        network = stack.enter_context(netem.Network(netem.Link.parse(link), config.world_size, slow, config.servers))
        with torch_logs.applied():
            store = network.in_hub(lambda: rendezvous.host_store(HUB_ADDRESS, port, 60.0, _PORT_FIX))
    create_keys(store, config.world_size, config.num_workers)
    return network, store


def offer_join(config: JobConfig, run_dir: str, store: dist.TCPStore, network: netem.Network | None) -> bool:
    """Leave join.json in the run directory when workers can join this job (async ps over torch RPC, on this
    machine's loopback); returns whether it did."""
    if not newcomers.joinable(config) or network is not None:
        return False
    newcomers.write_join_file(run_dir, HOST, store.port, job_id(store))
    return True
