"""Roles, rendezvous, and the bounded start-up and shutdown of RPC and the process group.

`init` reads the job's settings (arguments, then the launcher's environment),
connects to the rendezvous store, starts the rank's heartbeat (`liveness`),
torch RPC on every rank and, for the allreduce and hybrid strategies, a
gloo/nccl process group among the workers. On a server it then serves until
every worker has left (`shutdown`), and exits the process. Every wait here is
bounded, and a failure is recorded for the launcher and the other ranks.
In an elastic job (async or ssp ps) a worker that died counts as left, and a
process can join a running async job as a new worker (`newcomers`).
"""
from __future__ import annotations

import atexit
import datetime
import errno
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import traceback

import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, StoreKeys, job_keywords, worker_name
from gradsync.core import settings
from gradsync.core.torch_internals import start_dist_autograd
from gradsync.core.errors import blamed_worker
from gradsync.membership import newcomers, uneven_data
from gradsync.membership.liveness import Heartbeat, die_with_launcher, record_gone, staying, wait_for_arrivals
from gradsync.runtime import malloc, resume
from gradsync.transport import rpc_group
from gradsync.transport.rpc import install, start_rpc, stop_rpc

_STATE: "Cluster | None" = None


class Cluster:
    """This process's place in the running job."""

    def __init__(self, config: JobConfig, store: dist.Store, heartbeat: Heartbeat, joined: bool = False):
        self.config = config
        self.store = store
        self.heartbeat = heartbeat
        self.joined = joined  # joined the running job: its failure is its own, not the job's
        self.has_process_group = False
        self.steps = 0  # steps this worker has committed (Trainer.step; allreduce: and answered after joining)
        self.resumed: resume.Found | None = None  # the checkpoint this job resumes from (--resume)

    def building_trainer(self) -> None:
        """Note in the store that this worker builds its Trainer, so that a worker that never does is named
        (`liveness.Watch.without_trainer`) rather than one that waited for it."""
        self.store.append(StoreKeys.TRAINERS, f"{self.config.worker_rank},")

    def exit_now(self, text: str) -> None:
        """Fail this rank from a thread other than the main one, which waits where no exception can reach it
        (a collective in C++): record `text` and the main thread's stack, and exit the process with status 1."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        text += "\nThe main thread was here:\n" + "".join(traceback.format_stack(frame))
        say_failure(record_failure(self, self.config.rank, text))
        os._exit(1)


def current() -> Cluster:
    """The running job; raises if `gradsync.init` was not called."""
    if _STATE is None:
        raise RuntimeError("gradsync is not initialized in this process: call gradsync.init() first")
    return _STATE


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def host_store(host: str, port: int, timeout: float, fix: str) -> dist.TCPStore:
    """Host a rendezvous store that listens on `host` only; port 0 picks a free one.

    torch's TCPStore listens on every interface whatever host it is given, so the socket is bound here and
    handed over (`master_listen_fd`; the store closes it). `fix` ends the error for a port already in use.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use: {fix}") from e
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"cannot host the rendezvous store on {host}: it is not an address of this machine "
                "(MASTER_ADDR must name the machine of rank 0)"
            ) from e
        raise
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def connect_store(config: JobConfig) -> dist.TCPStore:
    """Connect to the rendezvous store, hosting it on rank 0 unless a launcher already does."""
    if config.rank == 0 and not config.store_is_hosted:
        return host_store(config.master_addr, config.master_port, config.startup_timeout,
                          "pick a free one (MASTER_PORT, or --master-port 0 with gradsync run to let it choose)")
    try:
        return dist.TCPStore(config.master_addr, config.master_port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=config.startup_timeout))
    except dist.DistError as e:
        host = "its launcher" if config.store_is_hosted else "rank 0"
        raise TimeoutError(
            f"rank {config.rank} ({config.name}) could not reach the rendezvous store at {config.master_addr}:"
            f"{config.master_port} within startup_timeout ({config.startup_timeout:.0f} s): {host} hosts it; is "
            f"it running, and are MASTER_ADDR and MASTER_PORT its address? ({e})") from e


def _check_launched(strategy: str | None) -> None:
    """Refuse a process that no launcher started, or torchrun without a strategy: it would wait for ranks that
    never come, or quietly train as something the user did not choose."""
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            "gradsync.init() found no launcher (WORLD_SIZE is not set): start the script with `gradsync run "
            "--strategy ps --workers 2 SCRIPT` (or --strategy allreduce, hybrid), or with torchrun and "
            "GRADSYNC_STRATEGY set, e.g. `GRADSYNC_STRATEGY=ps torchrun --nproc-per-node 3 SCRIPT` (the first "
            "GRADSYNC_SERVERS ranks, default 1, are the parameter servers)")
    if strategy is None and not settings.STRATEGY.given():
        raise ConfigError(
            "no strategy: set GRADSYNC_STRATEGY to ps, allreduce or hybrid (under torchrun; with ps and hybrid "
            "the first GRADSYNC_SERVERS ranks, default 1, are the parameter servers), or pass "
            "gradsync.init(strategy=...)")


def _use_loopback_interfaces(config: JobConfig) -> None:
    """Keep TensorPipe and gloo on the loopback device when the whole job is on this machine."""
    if is_loopback(config.master_addr):
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _report_failures(cluster: Cluster | None) -> None:
    """On an uncaught exception: record it (`record_failure`), say it (`say_failure`), and exit at once: a
    process whose heartbeat thread, store connection or RPC agent still runs would abort (SIGABRT) at
    interpreter exit, and its launcher would report that signal instead of the exception. Before the rank
    has a `Cluster` (a bad setting in `init`), the failure goes to the launcher's file only: one headline,
    not a traceback per rank."""

    def hook(kind, value, tb):
        rank = cluster.config.rank if cluster is not None else int(os.environ.get("RANK", "0"))
        text = record_failure(cluster, rank, "".join(traceback.format_exception(kind, value, tb)))
        say_failure(text)
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook


_NO_PROCESS_GROUP = "Default process group has not been initialized"  # torch's error, e.g. from DistributedSampler
_SAMPLER_HINT = ("gradsync: the ps strategy has no torch.distributed process group: give DistributedSampler its "
                 "place explicitly, DistributedSampler(dataset, num_replicas=gradsync.num_workers(), "
                 "rank=gradsync.worker_rank()) (the same works under every strategy)\n")


def say_failure(text: str) -> None:
    """Write a rank's failure to stderr, unless a gradsync launcher (GRADSYNC_ERROR_FILE) shows it: once, in
    the job's headline, not once per rank."""
    if not settings.ERROR_FILE.read():
        sys.stderr.write(text)
    sys.stderr.flush()


def record_failure(cluster: Cluster | None, rank: int, text: str) -> str:
    """Save a rank's failure for the launcher (GRADSYNC_ERROR_FILE) and the other ranks (the store; not from a
    worker that joined the running job, whose launcher records it gone), with a hint for an exception
    gradsync can explain and the ranks this one has seen fall silent for half the step timeout, or not build
    their Trainer: the likely cause. A failure whose text blames a worker (`blamed_worker`: its non-finite
    gradient) is recorded in the store under that worker's rank, so the launcher's headline names it. Returns
    the text saved."""
    if cluster is not None and cluster.config.strategy == "ps" and _NO_PROCESS_GROUP in text:
        text += _SAMPLER_HINT
    if cluster is not None:
        config, watch = cluster.config, cluster.heartbeat.watch
        silent = watch.silent(config.step_timeout / 2)
        if silent:
            text += f"gradsync: {watch.describe(silent)}: stopped, hung or dead?\n"
        late = watch.without_trainer(min(config.startup_timeout, config.step_timeout) / 2)
        if late:
            text += f"gradsync: {watch.describe_without_trainer(late)}\n"
    path = settings.ERROR_FILE.read()
    if path:
        with open(path, "w") as f:
            f.write(text)
    if cluster is not None and not cluster.joined:
        blamed = blamed_worker(text)
        if blamed is not None and blamed < cluster.config.num_workers:
            rank = cluster.config.servers + blamed
        try:
            cluster.store.compare_set(StoreKeys.FAILED, "", f"rank {rank}: {text}")
        except Exception:  # the store may be gone already; the launcher still has the file
            pass
    return text


def init(strategy=None, mode=None, servers=None, *, nonfinite=None, compression=None, transport=None,
         join=None, **timeouts) -> None:
    """Join the job. Every rank must call it.

    Args:
        strategy: 'ps', 'allreduce' or 'hybrid' (default: GRADSYNC_STRATEGY; one of the two is required).
        mode: 'sync', 'async' or 'ssp' (default: GRADSYNC_MODE, else 'sync'); with 'ssp', pass
            staleness=K (or GRADSYNC_STALENESS).
        servers: number of parameter servers, the first ranks (default: GRADSYNC_SERVERS).
        nonfinite: 'raise' or 'skip' for NaN/Inf gradients.
        compression: 'none', 'fp16', 'bf16' or 'int8' gradients on the wire.
        transport: 'rpc' (torch RPC) or 'grpc' (ps only: pulls and pushes over gRPC, no TensorPipe).
        join: a running async ps job's run directory, or its store's HOST:PORT (default: GRADSYNC_JOIN): join
            it as a new worker, with the job's settings (README, "Elastic async workers").
        timeouts: the other job settings: startup_timeout, step_timeout, shutdown_timeout (seconds);
            staleness (steps, mode 'ssp'); server_device, bucket_cap_mb; checkpoint_dir and checkpoint_every
            (steps), resume (a checkpoint directory): see README, "Checkpoint and resume", and the settings
            table of docs/architecture.md.
    On a server this call serves until the job ends and then exits the process.
    Raises:
        ConfigError: no launcher started this process (no WORLD_SIZE: start it with `gradsync run` or
            torchrun), no strategy, or a bad setting.
        TypeError: a keyword that is no job setting.
        TimeoutError: some rank did not reach init() within startup_timeout (naming it).
    """
    global _STATE
    asked = dict(strategy=strategy, mode=mode, servers=servers, nonfinite=nonfinite, compression=compression,
                 transport=transport, **job_keywords(timeouts, "gradsync.init"))
    join = join or settings.JOIN.read()
    if join and _STATE is None:
        _STATE = _join_running(join, asked)
        return
    if _STATE is not None:
        _join_launched(_STATE.config, JobConfig.from_env(**asked))
        return
    _check_launched(strategy)
    if settings.ERROR_FILE.given():  # under gradsync's launcher, which shows it
        _report_failures(None)
    config = JobConfig.from_env(**asked)
    die_with_launcher()
    malloc.limit_arenas()  # before the heartbeat, RPC and gloo threads make arenas of their own
    _use_loopback_interfaces(config)
    store = connect_store(config)
    _STATE = Cluster(config, store, Heartbeat(store, config))
    _report_failures(_STATE)
    atexit.register(_note_exit_without_shutdown)
    if config.rank == 0:  # for workers that join (an async job), and to refuse them at once (any other)
        newcomers.publish_settings(store, config)
    wait_for_arrivals(store, config)
    _STATE.resumed = resume.find(config)
    server = _install_server(config, _STATE.resumed) if config.is_server else None
    if config.transport == "rpc":
        start_rpc(config, store)
    else:  # gRPC carries everything; contexts still work without an RPC agent
        start_dist_autograd(config.rank)
    if server is not None:
        _serve(_STATE, server)
    elif config.strategy in ("allreduce", "hybrid"):
        dist.init_process_group(
            "nccl" if _use_cuda() else "gloo",
            store=dist.PrefixStore(StoreKeys.PROCESS_GROUP, store),
            rank=config.worker_rank,
            world_size=config.num_workers,
            timeout=datetime.timedelta(seconds=config.step_timeout),
        )
        _STATE.has_process_group = True


def _join_running(target: str, asked: dict) -> Cluster:
    """Join the running async job at `target` (run directory or HOST:PORT of its store) as a new worker."""
    die_with_launcher()
    malloc.limit_arenas()
    host, port = newcomers.store_address(target)
    timeout = asked.get("startup_timeout") or settings.STARTUP_TIMEOUT.read()
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
    except dist.DistError as e:
        raise ConnectionError(f"cannot reach the store of the job to join at {host}:{port} (has it ended?): {e}") from e
    config = newcomers.joiner_config(store, host, port, asked, timeout)
    _use_loopback_interfaces(config)
    cluster = Cluster(config, store, Heartbeat(store, config), joined=True)
    _report_failures(cluster)
    start_rpc(config, store)
    return cluster


def _note_exit_without_shutdown() -> None:
    """At interpreter exit of a worker that never called gradsync.shutdown(): say so in the store, so the
    launcher names it as the cause, whatever its exit ends in (torch's teardown of a running RPC agent or
    process group may abort it: SIGABRT)."""
    if _STATE is not None and not _STATE.config.is_server:
        try:
            _STATE.store.append(StoreKeys.EXITED, f"{_STATE.config.worker_rank},")
        except dist.DistError:  # the store is gone: the job has ended
            pass


def _join_launched(running: JobConfig, asked: JobConfig) -> None:
    """A second init() is fine inside `gradsync.launch`'s function when it asks for the job that runs."""
    if not settings.LAUNCHED.read():
        raise RuntimeError("gradsync.init() was already called in this process")
    differ = [f"{f}={getattr(asked, f)!r} (the job runs {getattr(running, f)!r})"
              for f in settings.SHARED
              if getattr(asked, f) != getattr(running, f)]
    if differ:
        raise ConfigError(
            f"gradsync.init() inside gradsync.launch asked for {', '.join(differ)}: pass those settings to "
            "gradsync.launch(...), or call gradsync.init() with no arguments"
        )


def _use_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and settings.DEVICE.read() == "cuda"


def _install_server(config: JobConfig, resumed: resume.Found | None):
    """Create this process's parameter server before RPC starts, so no request can arrive first."""
    from gradsync.ps.server import ParameterServer

    server = ParameterServer(
        config.rank, config.num_workers, config.mode, config.nonfinite, config.compression, config.server_device,
        config.staleness, (resumed.path, resumed.manifest["servers"]) if resumed else None,
    )
    install(server)
    return server


def _serve(cluster: Cluster, server) -> None:
    """Serve until every worker has left, then exit the process: 0, or 1 when the job failed (recorded here:
    an exception must not leave a process whose RPC agent still runs, as interpreter exit then aborts it)."""
    from gradsync.transport.grpc import register_from_store, start_endpoint

    config = cluster.config
    code = 0
    try:
        cluster.heartbeat.on_left(server.worker_left)
        uneven_data.serve(cluster.store, server, config.num_workers)
        endpoint = start_endpoint(server, cluster.store, config.step_timeout)
        if config.transport == "grpc":
            register_from_store(server, cluster.store, config)
        _wait_for_workers(cluster, deadline=None)
        _write_stats(server)
        if config.transport == "rpc" and config.elastic:
            rpc_group.leave(config, cluster.store, config.shutdown_timeout)
        elif config.transport == "rpc":
            stop_rpc(config.shutdown_timeout)
        endpoint.stop()
    except BaseException:
        say_failure(record_failure(cluster, config.rank, traceback.format_exc()))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write_stats(server) -> None:
    """The server's final counters as `stats-<shard>.json` in the run directory (`gradsync compare` reads them)."""
    from gradsync.core.atomic_file import write_atomically
    from gradsync.transport.grpc import run_dir

    if server.shard is not None:
        stats = {**server.stats(), "tables": server.table_stats()}
        write_atomically(os.path.join(run_dir(), f"stats-{server.shard_id}.json"), json.dumps(stats).encode())


def _wait_for_workers(cluster: Cluster, deadline: float | None) -> list[int]:
    """Wait until every worker has left the job (or, in an elastic job, is gone), or until `deadline`
    (time.monotonic()); returns the workers still in it.

    Raises:
        RuntimeError: another rank failed; or, with no deadline (a server, which waits the whole job), a rank
            has sent no heartbeat for step_timeout: the job cannot go on without it. A worker that joined an
            elastic job is recorded gone instead: no launcher of the job watches it.
    """
    config, store, watch = cluster.config, cluster.store, cluster.heartbeat.watch
    while True:
        in_job = staying(store)
        if not in_job or (deadline is not None and time.monotonic() >= deadline):
            return in_job
        if store.check([StoreKeys.FAILED]):
            raise RuntimeError(f"another rank failed, stopping: {store.get(StoreKeys.FAILED).decode()[:2000]}")
        silent = watch.silent(config.step_timeout) if deadline is None else {}
        for rank in [r for r in silent if config.elastic and r >= config.world_size]:
            record_gone(store, rank - config.servers, f"sent no heartbeat for {silent.pop(rank):.0f} s")
        if silent:
            raise RuntimeError(f"{watch.describe(silent)} (step_timeout {config.step_timeout:.0f} s): it is "
                               "stopped, hung or dead, and the job cannot go on without it")
        time.sleep(0.05)


def shutdown() -> None:
    """Leave the job. Every worker must call it; it returns within shutdown_timeout whatever the others do.

    Marks this worker as left (a peer waiting for a step with it fails at once, naming it), waits for the
    other workers to leave too (RPC's graceful shutdown needs every rank), then stops the process group and
    RPC; when some have not left by the timeout, it says which and stops without them. A worker of an
    elastic job waits for no one: it stops its RPC agent once its own calls are answered (`rpc_group.leave`).
    Raises:
        RuntimeError: another rank failed (waiting for the others).
    """
    global _STATE
    if _STATE is None:
        return
    cluster, _STATE = _STATE, None
    config = cluster.config
    deadline = time.monotonic() + config.shutdown_timeout
    cluster.store.append(StoreKeys.LEFT, f"{config.worker_rank}:{cluster.steps},")
    newcomers.note_left(config.worker_rank)
    others = None  # the workers still in the job (None: not waited for)
    try:
        if not config.elastic:
            others = _wait_for_workers(cluster, deadline)
        if others:
            print(f"gradsync: shutdown waited {config.shutdown_timeout:.0f} s (shutdown_timeout) for "
                  f"{', '.join(worker_name(w) for w in others)} to leave the job; leaving without them",
                  file=sys.stderr, flush=True)
    finally:
        cluster.heartbeat.stop(max(deadline - time.monotonic(), 1.0))
        if cluster.has_process_group:
            dist.destroy_process_group()
        if config.transport == "rpc" and config.elastic:
            rpc_group.leave(config, cluster.store, max(deadline - time.monotonic(), 1.0))
        elif config.transport == "rpc":
            stop_rpc(max(deadline - time.monotonic(), 1.0) if others == [] else None)


def worker_rank() -> int:
    """This worker's index, 0 .. num_workers()-1."""
    return current().config.worker_rank


def num_workers() -> int:
    return current().config.num_workers
