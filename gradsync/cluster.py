"""Roles, rendezvous, and the bounded start-up and shutdown of RPC and the process group.

`init` reads the job's settings (arguments, then the launcher's environment),
connects to the rendezvous store, starts torch RPC on every rank and, for the
allreduce strategy, a gloo/nccl process group among the workers. On a server
it then serves until every worker has called `shutdown`, and exits the process.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys
import time
import traceback

import torch.distributed as dist
import torch.distributed.autograd as dist_autograd

from gradsync.config import ConfigError, JobConfig, StoreKeys
from gradsync.transport.rpc import install, start_rpc, stop_rpc

_STATE: "Cluster | None" = None


class Cluster:
    """This process's place in the running job."""

    def __init__(self, config: JobConfig, store: dist.Store):
        self.config = config
        self.store = store
        self.has_process_group = False


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


def connect_store(config: JobConfig) -> dist.TCPStore:
    """Connect to the rendezvous store, hosting it on rank 0 unless a launcher already does."""
    is_master = config.rank == 0 and not config.store_is_hosted
    try:
        return dist.TCPStore(
            config.master_addr,
            config.master_port,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=config.startup_timeout),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        if is_master and "in use" in str(e).lower():
            raise ConfigError(
                f"port {config.master_port} on {config.master_addr} is already in use: pick a free one "
                "(MASTER_PORT, or --master-port 0 with gradsync run to let it choose)"
            ) from e
        raise


def _use_loopback_interfaces(config: JobConfig) -> None:
    """Keep TensorPipe and gloo on the loopback device when the whole job is on this machine."""
    if is_loopback(config.master_addr):
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _report_failures(store: dist.Store, rank: int) -> None:
    """On an uncaught exception: write it to the launcher's error file and tell the other ranks."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        record_failure(store, rank, text)
        previous(kind, value, tb)

    sys.excepthook = hook


def record_failure(store: dist.Store | None, rank: int, text: str) -> None:
    """Save a rank's traceback for the launcher (GRADSYNC_ERROR_FILE) and the other ranks (the store)."""
    path = os.environ.get("GRADSYNC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            f.write(text)
    if store is not None:
        try:
            store.compare_set(StoreKeys.FAILED, "", f"rank {rank}: {text}")
        except Exception:  # the store may be gone already; the launcher still has the file
            pass


def init(strategy=None, mode=None, servers=None, *, nonfinite=None, compression=None, transport=None,
         **timeouts) -> None:
    """Join the job. Every rank must call it.

    Args:
        strategy: 'ps', 'allreduce' or 'hybrid' (default: GRADSYNC_STRATEGY, else 'ps').
        mode: 'sync' or 'async' (default: GRADSYNC_MODE, else 'sync').
        servers: number of parameter servers, the first ranks (default: GRADSYNC_SERVERS).
        nonfinite: 'raise' or 'skip' for NaN/Inf gradients.
        compression: 'none', 'fp16', 'bf16' or 'int8' gradients on the wire.
        transport: 'rpc' (torch RPC) or 'grpc' (ps only: pulls and pushes over gRPC, no TensorPipe).
        timeouts: startup_timeout, step_timeout, shutdown_timeout (seconds).
    On a server this call serves until the job ends and then exits the process.
    """
    global _STATE
    config = JobConfig.from_env(
        strategy=strategy, mode=mode, servers=servers, nonfinite=nonfinite, compression=compression,
        transport=transport, **timeouts
    )
    if _STATE is not None:
        _join_launched(_STATE.config, config)
        return
    _use_loopback_interfaces(config)
    store = connect_store(config)
    _report_failures(store, config.rank)
    _STATE = Cluster(config, store)
    server = _install_server(config) if config.is_server else None
    if config.transport == "rpc":
        start_rpc(config, store)
    else:  # gRPC carries everything; contexts still work without an RPC agent
        dist_autograd._init(config.rank)
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


def _join_launched(running: JobConfig, asked: JobConfig) -> None:
    """A second init() is fine inside `gradsync.launch`'s function when it asks for the job that runs."""
    if os.environ.get("GRADSYNC_LAUNCHED") != "1":
        raise RuntimeError("gradsync.init() was already called in this process")
    differ = [f"{f}={getattr(asked, f)!r} (the job runs {getattr(running, f)!r})"
              for f in ("strategy", "mode", "servers", "nonfinite", "compression", "transport")
              if getattr(asked, f) != getattr(running, f)]
    if differ:
        raise ConfigError(
            f"gradsync.init() inside gradsync.launch asked for {', '.join(differ)}: pass those settings to "
            "gradsync.launch(...), or call gradsync.init() with no arguments"
        )


def _use_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("GRADSYNC_DEVICE", "cuda") == "cuda"


def _install_server(config: JobConfig):
    """Create this process's parameter server before RPC starts, so no request can arrive first."""
    from gradsync.ps.server import ParameterServer

    server = ParameterServer(
        config.rank, config.num_workers, config.mode, config.nonfinite, config.compression, config.server_device
    )
    install(server)
    return server


def _serve(cluster: Cluster, server) -> None:
    from gradsync.transport.grpc import register_from_store, start_endpoint

    config = cluster.config
    endpoint = start_endpoint(server, cluster.store, config.step_timeout)
    try:
        if config.transport == "grpc":
            register_from_store(server, cluster.store, config)
        _wait_for_workers(cluster)
        if config.transport == "rpc":
            stop_rpc(config)
        endpoint.stop()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _wait_for_workers(cluster: Cluster) -> None:
    """Wait until every worker has called shutdown; fail fast when another rank reported a failure."""
    store, workers = cluster.store, cluster.config.num_workers
    while store.add(StoreKeys.DONE, 0) < workers:
        if store.check([StoreKeys.FAILED]):
            raise RuntimeError(f"another rank failed, stopping: {store.get(StoreKeys.FAILED).decode()[:2000]}")
        time.sleep(0.05)


def shutdown() -> None:
    """Leave the job: waits (bounded by the other workers finishing) and stops RPC. Every worker must call it."""
    global _STATE
    if _STATE is None:
        return
    cluster, _STATE = _STATE, None
    cluster.store.add(StoreKeys.DONE, 1)
    try:
        _wait_for_workers(cluster)
    finally:
        if cluster.has_process_group:
            dist.destroy_process_group()
        if cluster.config.transport == "rpc":
            stop_rpc(cluster.config)


def worker_rank() -> int:
    """This worker's index, 0 .. num_workers()-1."""
    return current().config.worker_rank


def num_workers() -> int:
    return current().config.num_workers
