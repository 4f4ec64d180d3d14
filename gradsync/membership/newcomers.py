"""Newcomers: workers that join a running async ps job. Where its store is, its settings, a fresh worker index.

The launcher of an elastic job that runs over torch RPC writes `join.json` (the rendezvous store's address and the job's
id, mode 0600) into the run directory, and a joining process checks that the store there is that job's; rank 0 of every
job publishes its settings (its GRADSYNC_* variables) in the store, so that joining a job that takes no newcomers fails
at once. A joining process (`gradsync run --join RUN_DIR script.py`, or GRADSYNC_JOIN=RUN_DIR|HOST:PORT for
`gradsync.init()`) connects to the store, takes the next worker index (`gradsync/workers`, an atomic counter), creates
its heartbeat counter at once, and starts as that worker: rank servers + index, RPC name worker<index>. The servers
admit its registration while the job runs and its first step pulls their current parameters.
"""

from __future__ import annotations

import datetime
import json
import os

import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, settings_from_env
from gradsync.core import settings
from gradsync.core.atomic_file import write_atomically
from gradsync.core.job_names import StoreKeys
from gradsync.core.transport_capabilities import capabilities

JOIN_FILE = "join.json"


def joinable(config: JobConfig) -> bool:
    """Whether workers can join this job while it runs: async ps over a transport that takes them (torch RPC)."""
    return config.elastic and config.mode == "async" and capabilities(config.transport).joining


def write_join_file(run_dir: str, host: str, port: int, job: str) -> None:
    """Leave the address of the store of job `job` (`transport.grpc.endpoint_files.job_id`) in the run directory
    (owner-only: the store has no authentication)."""
    write_atomically(os.path.join(run_dir, JOIN_FILE), json.dumps({"host": host, "port": port, "job": job}).encode())


def store_address(target: str) -> tuple[str, int, str]:
    """(host, port, job id) of a running job's store, from its run directory (join.json) or 'host:port' (no job
    id: "").

    Raises:
        ConfigError: naming `target` and what it must be.
    """
    if os.path.isdir(target):
        path = os.path.join(target, JOIN_FILE)
        if not os.path.exists(path):
            raise ConfigError(
                f"{target} has no {JOIN_FILE}: workers can join an async ps job over torch RPC while it runs "
                "(gradsync run --strategy ps --mode async ... writes it into its run directory)"
            )
        with open(path) as f:
            found = json.load(f)
        return found["host"], int(found["port"]), found.get("job", "")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"cannot join {target!r}: give the job's run directory or its store address as HOST:PORT")
    return host, int(port), ""


def connect(target: str, timeout: float) -> tuple[dist.TCPStore, str, int]:
    """A client of the store of the running job at `target` (`store_address`), and that store's host and port.

    Raises:
        ConfigError: `target` names no job (`store_address`).
        ConnectionError: the store cannot be reached within `timeout` seconds (the job has ended?), or it is
            another job's than the one `target`'s join.json names.
    """
    host, port, job = store_address(target)
    try:
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
        )
    except dist.DistError as e:
        raise ConnectionError(f"cannot reach the store of the job to join at {host}:{port} (has it ended?): {e}") from e
    served = store.get(StoreKeys.JOB_ID).decode() if job and store.check([StoreKeys.JOB_ID]) else ""
    if job and served != job:
        raise ConnectionError(
            f"the store at {host}:{port} is job {served or '(unnamed)'}'s, not job {job}'s that "
            f"{os.path.join(target, JOIN_FILE)} names: that job has ended and another listens there; give the run "
            "directory of a running async job"
        )
    return store, host, port


def publish_settings(store: dist.Store, config: JobConfig) -> None:
    """On rank 0: the job's settings, for the workers that join it (an async job) or to refuse them at once."""
    store.compare_set(StoreKeys.JOB, "", json.dumps(config.to_env()))


def job_settings(store: dist.Store, host: str, port: int, timeout: float) -> dict:
    """The settings of the job at host:port (`settings_from_env` values), waiting up to `timeout` seconds for
    its rank 0 to publish them.

    Raises:
        ConfigError: the job does not take joining workers, or published nothing in time.
    """
    try:
        store.wait([StoreKeys.JOB], datetime.timedelta(seconds=timeout))
    except dist.DistError as e:
        raise ConfigError(
            f"the job at {host}:{port} published no settings within {timeout:.0f} s: is it a "
            f"gradsync job, and has its rank 0 started? ({e})"
        ) from e
    values = settings_from_env(json.loads(store.get(StoreKeys.JOB)))
    job = JobConfig(**values, world_size=values["servers"] + 1)
    if not joinable(job):
        raise ConfigError(
            f"the job at {host}:{port} runs strategy={job.strategy!r}, mode={job.mode!r}, transport="
            f"{job.transport!r}: workers join async ps jobs over torch RPC (--strategy ps --mode async "
            "--transport rpc); over gRPC, push from outside the job with gradsync.client.Client"
        )
    return values


def note_left(index: int) -> None:
    """In a joining process, as gradsync.shutdown() leaves the job: say so in the index file
    (GRADSYNC_JOIN_INDEX_FILE), which `gradsync run --join` reads even once the job's store is gone."""
    path = settings.JOIN_INDEX_FILE.read()
    if path:
        write_atomically(path, f"{index} left".encode())


def read_index_file(path: str) -> tuple[int, bool]:
    """(the worker index a joining process took, whether it left the job with gradsync.shutdown())."""
    with open(path) as f:
        index, _, left = f.read().partition(" ")
    return int(index), left == "left"


def joiner_config(store: dist.Store, host: str, port: int, asked: dict, timeout: float) -> JobConfig:
    """This joining process's place in the job: the job's settings and the next worker index, whose
    heartbeat counter is created at once (the others watch it from then on).

    Args:
        asked: settings given to gradsync.init (None: not given): the job's (strategy, mode...) must match
            it, this process's own (timeouts) replace the job's.
        timeout: seconds to wait for the job's settings.
    Raises:
        ConfigError: the job does not take joining workers, or runs other settings than `asked`.
    """
    values = job_settings(store, host, port, timeout)
    differ = [
        f"{k}={v!r} (the job runs {values[k]!r}{'' if values[k] is not None else ': chosen at start-up'})"
        for k, v in asked.items()
        if v is not None and k in settings.SHARED and v != values[k]
    ]
    if differ:
        raise ConfigError(
            f"joining the job at {host}:{port} with {', '.join(differ)}: leave those settings "
            "out, a joining worker takes the job's"
        )
    values.update({k: v for k, v in asked.items() if v is not None and k not in settings.SHARED})
    index = store.add(StoreKeys.WORKERS, 1) - 1
    rank = values["servers"] + index
    store.add(StoreKeys.ALIVE.format(rank), 0)
    path = settings.JOIN_INDEX_FILE.read()
    if path:
        write_atomically(path, str(index).encode())
    return JobConfig(**values, rank=rank, world_size=rank + 1, master_addr=host, master_port=port, store_is_hosted=True)
