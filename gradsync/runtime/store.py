"""The job's rendezvous store: hosted on rank 0 (or by a launcher) on its address only, reached by every rank."""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket

import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def use_loopback_interfaces(config: JobConfig) -> None:
    """Keep TensorPipe and gloo on the loopback device when the whole job is on this machine."""
    if is_loopback(config.master_addr):
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


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
        return dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def connect_store(config: JobConfig) -> dist.TCPStore:
    """Connect to the rendezvous store, hosting it on rank 0 unless a launcher already does."""
    if config.rank == 0 and not config.store_is_hosted:
        return host_store(
            config.master_addr,
            config.master_port,
            config.startup_timeout,
            "pick a free one (MASTER_PORT, or --master-port 0 with gradsync run to let it choose)",
        )
    try:
        return dist.TCPStore(
            config.master_addr,
            config.master_port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.startup_timeout),
        )
    except dist.DistError as e:
        host = "its launcher" if config.store_is_hosted else "rank 0"
        raise TimeoutError(
            f"rank {config.rank} ({config.name}) could not reach the rendezvous store at {config.master_addr}:"
            f"{config.master_port} within startup_timeout ({config.startup_timeout:.0f} s): {host} hosts it; is "
            f"it running, and are MASTER_ADDR and MASTER_PORT its address? ({e})"
        ) from e
