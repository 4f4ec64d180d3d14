"""Joining the job: `gradsync.init` and its three paths.

A launched rank reads the job's settings (arguments, then the launcher's
environment), connects to the rendezvous store, starts its heartbeat
(`membership.heartbeat`) and the job's transport on every rank and, for the allreduce and
hybrid strategies, a gloo/nccl process group among the workers; a server then
serves until every worker has left (`runtime.serving`) and exits the process.
A process can join a running async job as a new worker (`newcomers`), and a
second `init()` inside `gradsync.launch`'s function joins the job that runs.
Every wait here is bounded, and a failure is recorded for the launcher and the
other ranks (`runtime.failures`).
"""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, job_keywords
from gradsync.core import malloc, settings
from gradsync.core.errors import init_in_a_child_error
from gradsync.core.job_names import StoreKeys
from gradsync.core.settings import ERROR_FILE, JOIN  # by name in init, whose **settings are its keywords
from gradsync.core.strategies import traits
from gradsync.core.torch_internals import importing_main_for_a_child
from gradsync.membership import newcomers
from gradsync.membership.arrivals import wait_for_arrivals
from gradsync.membership.heartbeat import Heartbeat
from gradsync.membership.launcher_death import die_with_launcher
from gradsync.membership.rank_reports import register_stack_file, release_early_stderr
from gradsync.runtime import checkpoints
from gradsync.runtime import cluster as job
from gradsync.runtime.failures import report_failures
from gradsync.runtime.serving import install_server, serve
from gradsync.runtime.store import connect_store, use_loopback_interfaces
from gradsync.transport import registry


def init(
    strategy=None, mode=None, servers=None, *, nonfinite=None, compression=None, transport=None, join=None, **settings
) -> None:
    """Join the job. Every rank must call it.

    Args:
        strategy: 'ps', 'allreduce', 'hybrid' or 'sharded' (default: GRADSYNC_STRATEGY; one of the two is required).
        mode: 'sync', 'async' or 'ssp' (default: GRADSYNC_MODE, else 'sync'); with 'ssp', pass
            staleness=K (or GRADSYNC_STALENESS).
        servers: number of parameter servers, the first ranks (default: GRADSYNC_SERVERS).
        nonfinite: 'raise' or 'skip' for NaN/Inf gradients.
        compression: 'none', 'fp16', 'bf16' or 'int8' gradients on the wire.
        transport: 'rpc' (torch RPC) or 'grpc' (ps only: pulls and pushes over gRPC, no TensorPipe).
        join: a running async ps job's run directory, or its store's HOST:PORT (default: GRADSYNC_JOIN): join
            it as a new worker, with the job's settings (README, "Elastic async workers").
        settings: the other job settings: startup_timeout, step_timeout, shutdown_timeout (seconds);
            staleness (steps, mode 'ssp'); server_device, bucket_cap_mb; checkpoint_dir and checkpoint_every
            (steps), resume (a checkpoint directory), start_over (a new run in a checkpoint_dir holding another
            run's step folders, removed first): see README, "Checkpoint and resume", and the settings
            table of docs/architecture.md.
    On a server this call serves until the job ends and then exits the process.
    Raises:
        ConfigError: no launcher started this process (no WORLD_SIZE: start it with `gradsync run` or
            torchrun), no strategy, or a bad setting.
        TypeError: a keyword that is no job setting.
        TimeoutError: some rank did not reach init() within startup_timeout (naming it).
    """
    if importing_main_for_a_child():
        raise init_in_a_child_error()
    asked = dict(
        strategy=strategy,
        mode=mode,
        servers=servers,
        nonfinite=nonfinite,
        compression=compression,
        transport=transport,
        **job_keywords(settings, "gradsync.init"),
    )
    join = join or JOIN.read()
    if join and job.running() is None:
        job.set_running(_join_running(join, asked))
        return
    if (running := job.running()) is not None:
        _join_launched(running.config, JobConfig.from_env(**asked))
        return
    _check_launched(strategy)
    if ERROR_FILE.given():  # under gradsync's launcher, which shows it
        report_failures(None)
    config = JobConfig.from_env(**asked)
    die_with_launcher()
    malloc.limit_arenas()  # before the heartbeat, RPC and gloo threads make arenas of their own
    use_loopback_interfaces(config)
    store = connect_store(config)
    release_early_stderr(store)
    register_stack_file()
    cluster = job.Cluster(config, store, Heartbeat(store, config))
    job.set_running(cluster)
    report_failures(cluster)
    atexit.register(_note_exit_without_shutdown)
    if config.rank == 0:  # for workers that join (an async job), and to refuse them at once (any other)
        newcomers.publish_settings(store, config)
    if not config.replacement:  # a dead worker's replacement comes into a job whose ranks all arrived
        wait_for_arrivals(store, config)
    cluster.run, cluster.resumed = checkpoints.open_run(config, store)
    servers = install_server(cluster) if config.is_server else None
    registry.transport(config.transport).rank.start(config, store)
    if servers is not None:
        serve(cluster, servers)
    elif traits(config.strategy).process_group and not config.replaces_workers:  # else by generation: the strategy's
        dist.init_process_group(
            process_group_backend(),
            store=dist.PrefixStore(StoreKeys.PROCESS_GROUP, store),
            rank=config.worker_rank,
            world_size=config.num_workers,
            timeout=datetime.timedelta(seconds=config.step_timeout),
        )
        cluster.has_process_group = True


def _join_running(target: str, asked: dict) -> job.Cluster:
    """Join the running async job at `target` (run directory or HOST:PORT of its store) as a new worker."""
    die_with_launcher()
    malloc.limit_arenas()
    timeout = asked.get("startup_timeout") or settings.STARTUP_TIMEOUT.read()
    store, host, port = newcomers.connect(target, timeout)
    config = newcomers.joiner_config(store, host, port, asked, timeout)
    use_loopback_interfaces(config)
    cluster = job.Cluster(config, store, Heartbeat(store, config), joined=True)
    report_failures(cluster)
    registry.transport(config.transport).rank.start(config, store)
    return cluster


def _note_exit_without_shutdown() -> None:
    """At interpreter exit of a worker that never called gradsync.shutdown(): say so in the store, so the
    launcher names it as the cause, whatever its exit ends in (torch's teardown of a running RPC agent or
    process group may abort it: SIGABRT)."""
    cluster = job.running()
    if cluster is not None and not cluster.config.is_server:
        try:
            # Store.append: missing from torch's stubs
            cluster.store.append(StoreKeys.EXITED, f"{cluster.config.worker_rank},")  # type: ignore[attr-defined]
        except dist.DistError:  # the store is gone: the job has ended
            pass


def _join_launched(running: JobConfig, asked: JobConfig) -> None:
    """A second init() is fine inside `gradsync.launch`'s function when it asks for the job that runs."""
    if not settings.LAUNCHED.read():
        raise RuntimeError("gradsync.init() was already called in this process")
    differ = [
        f"{f}={getattr(asked, f)!r} (the job runs {getattr(running, f)!r})"
        for f in settings.SHARED
        if getattr(asked, f) != getattr(running, f)
    ]
    if differ:
        raise ConfigError(
            f"gradsync.init() inside gradsync.launch asked for {', '.join(differ)}: pass those settings to "
            "gradsync.launch(...), or call gradsync.init() with no arguments"
        )


def _check_launched(strategy: str | None) -> None:
    """Refuse a process that no launcher started, or torchrun without a strategy: it would wait for ranks that
    never come, or quietly train as something the user did not choose."""
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            "gradsync.init() found no launcher (WORLD_SIZE is not set): start the script with `gradsync run "
            "--strategy ps --workers 2 SCRIPT` (or --strategy allreduce, hybrid, sharded), or with torchrun and "
            "GRADSYNC_STRATEGY set, e.g. `GRADSYNC_STRATEGY=ps torchrun --nproc-per-node 3 SCRIPT` (the first "
            "GRADSYNC_SERVERS ranks, default 1, are the parameter servers)"
        )
    if strategy is None and not settings.STRATEGY.given():
        raise ConfigError(
            "no strategy: set GRADSYNC_STRATEGY to ps, allreduce, hybrid or sharded (under torchrun; with ps and "
            "hybrid the first GRADSYNC_SERVERS ranks, default 1, are the parameter servers), or pass "
            "gradsync.init(strategy=...)"
        )


def process_group_backend() -> str:
    """The workers' process group: gloo for CPU tensors and, where CUDA is in use (GRADSYNC_DEVICE=cuda on a
    machine that has it), nccl for CUDA tensors beside it, so a model kept on a GPU machine's CPU trains too."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and settings.DEVICE.read() == "cuda" else "gloo"
