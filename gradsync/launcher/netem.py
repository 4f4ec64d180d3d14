"""An emulated network on one machine: each rank in its own network namespace behind a rate-limited link.

`Network(Link.parse("1gbit"), n)` creates a hub namespace holding a Linux bridge (address 10.213.0.1/24,
where the launcher hosts the rendezvous store) and one namespace per rank, joined to the bridge by a veth
pair (the rank's end 10.213.0.<rank + 2>/24). Both ends of every veth are shaped with `tc tbf` at the
link's rate, so a byte from rank a to rank b crosses a's uplink and b's downlink, as between machines on
one switch. The parameter servers (the first `servers` ranks) may sit behind a different rate
(`server_link`: a slow server link). Nothing is configured in the root namespace: links are created inside
the job's namespaces, whose names carry a job-unique prefix, and deleting the namespaces on exit removes
every link with them. A launcher killed by SIGKILL cannot delete them: each network holds a lease
(`gradsync.launcher.leases`) in LEASES, and the next network created on the machine deletes the namespaces
of every abandoned lease. Needs root and iproute2 (`ip`, `tc`).
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gradsync.config import ConfigError
from gradsync.core import settings
from gradsync.core.emulated_network import HUB_ADDRESS, SUBNET
from gradsync.launcher.leases import Lease, abandoned

PREFIX = "gsnet"
"""Every namespace a `Network` creates is named PREFIX + a job id + a suffix."""
LEASES = "/run/gradsync"
"""A lease file per network, `<job>.lease`: held by the launcher while its namespaces exist."""
MAX_RANKS = 250
DEVICE = "link0"
"""Each rank's network device, inside its namespace."""
_JOIN_TIMEOUT_S = 120.0
_CMD_TIMEOUT_S = 10.0
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000  # a mount namespace
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2
_UNITS = {"bit": 1, "bps": 8}
_SCALES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"(\d+(?:\.\d+)?)(k|m|g|t|ki|mi|gi|ti)?(bit|bps)", re.IGNORECASE)
T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    """A link's rate in bits per second, as `tc` writes rates (100mbit, 1gbit, 10gbit, 125mbps: bytes)."""

    bits_per_s: int

    @classmethod
    def parse(cls, rate: str, flag: str = "--link") -> Link:
        """`rate` as tc writes it; errors name `flag`, the option it came from."""
        match = _RATE.fullmatch(rate.strip())
        if not match:
            raise ConfigError(
                f"{flag} {rate!r} is not a tc rate: write a number and a unit, e.g. 100mbit, 1gbit, "
                "10gbit (bit, kbit, mbit, gbit, tbit; kibit...; bps, kbps, mbps, gbps: bytes/s)"
            )
        number, scale, unit = match.groups()
        bits = int(float(number) * _SCALES[(scale or "").lower()] * _UNITS[unit.lower()])
        if bits < 8000:
            raise ConfigError(f"{flag} {rate!r} is {bits} bit/s: a link needs at least 8kbit")
        return cls(bits)

    def __str__(self) -> str:
        return f"{self.bits_per_s}bit"

    @property
    def burst_bytes(self) -> int:
        """What the link passes at once after an idle moment: 4 ms at the rate, at least 64 KiB (one
        segmentation-offload packet)."""
        return max(self.bits_per_s // 8 // 250, 64 * 1024)

    def tbf(self) -> list[str]:
        """tc tbf parameters: the burst, and a queue of 20 ms."""
        return ["rate", str(self), "burst", str(self.burst_bytes), "latency", "20ms"]


def require_tools() -> None:
    """Raise ConfigError naming what an emulated network needs and this machine lacks."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"--link needs iproute2, but {' and '.join(repr(t) for t in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH "
            f"(PATH={os.environ.get('PATH', '')}): install iproute2, or run without --link"
        )
    if os.geteuid() != 0:
        raise ConfigError(
            f"--link creates network namespaces, which needs root (this is uid {os.geteuid()}): "
            "run as root, or without --link"
        )


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if done.returncode != 0:
        raise ConfigError(
            f"--link: `{' '.join(args)}` failed: {done.stderr.strip()} (an emulated network needs "
            "CAP_SYS_ADMIN and CAP_NET_ADMIN, and a kernel with veth, bridge and tbf): run on such "
            "a machine, or without --link"
        )


class Network:
    """The namespaces, bridge and shaped veth links of one job; a context manager that removes them all.
    Ranks 0 .. servers - 1 sit behind `server_link` when it is given, the others behind `link`."""

    def __init__(self, link: Link, ranks: int, server_link: Link | None = None, servers: int = 0):
        if not 1 <= ranks <= MAX_RANKS:
            raise ConfigError(f"an emulated network holds 1..{MAX_RANKS} ranks, got {ranks}: use fewer ranks")
        require_tools()
        self.links = [server_link if server_link is not None and rank < servers else link for rank in range(ranks)]
        self.job = PREFIX + secrets.token_hex(3)
        self.hub = self.job + "hub"
        self.namespaces = [f"{self.job}r{rank}" for rank in range(ranks)]
        self._created: list[str] = []
        self._lease: Lease | None = None

    def __enter__(self) -> Network:
        remove_abandoned()
        os.makedirs(LEASES, exist_ok=True)
        self._lease = Lease(os.path.join(LEASES, f"{self.job}.lease"))
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        if os.path.exists(f"/run/netns/{name}"):  # another job drew the same id: never take over its namespace
            raise ConfigError(f"--link: network namespace {name} exists already; run the job again")
        self._created.append(name)  # before `ip netns add`: an interrupted add may still leave it behind
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        self._add_namespace(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for rank, ns in enumerate(self.namespaces):
            self._add_namespace(ns)
            port, end = f"port{rank}", DEVICE
            _run("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", end, "netns", ns)
            _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", end)
            _run("ip", "-n", ns, "link", "set", end, "up")
            _run("tc", "-n", self.hub, "qdisc", "add", "dev", port, "root", "tbf", *self.links[rank].tbf())
            _run("tc", "-n", ns, "qdisc", "add", "dev", end, "root", "tbf", *self.links[rank].tbf())

    def close(self) -> None:
        """Delete every namespace this network created, which removes its links and bridge; idempotent.
        Processes still inside a namespace keep it alive until they exit: stop them first."""
        while self._created:
            _delete(self._created.pop())
        if self._lease is not None:
            self._lease.release()

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 2}"

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """`argv`, run inside the rank's namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]

    def environment(self, rank: int) -> dict[str, str]:
        """Where a rank finds the store, the device its RPC and collectives use, where a server's gRPC endpoint
        listens (so that `--transport grpc` workers reach it over the link), and its link's rate."""
        return {
            settings.MASTER_ADDR.env: HUB_ADDRESS,
            "TP_SOCKET_IFNAME": DEVICE,
            "GLOO_SOCKET_IFNAME": DEVICE,
            settings.GRPC_HOST.env: self.address(rank),
            settings.LINK.env: str(self.links[rank]),
        }

    def in_hub(self, fn: Callable[[], T]) -> T:
        """`fn()` on a thread inside the hub namespace: the sockets it opens stay there (the store's)."""
        return in_namespace(self.hub, fn)


def enter(name: str) -> None:
    """Move the calling thread into network namespace `name`; threads it starts afterwards are there too."""
    with open(f"/run/netns/{name}") as f:
        if ctypes.CDLL(None, use_errno=True).setns(f.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")


def enter_as_process(name: str) -> None:
    """Move this single-threaded process into network namespace `name` as `ip netns exec` does: its network,
    and a mount namespace of its own whose /sys shows that network's devices (a rank's /sys/class/net/link0)."""
    enter(name)
    libc = ctypes.CDLL(None, use_errno=True)
    steps = [
        (libc.unshare, (_CLONE_NEWNS,)),
        (libc.mount, (b"none", b"/", None, _MS_REC | _MS_SLAVE, None)),
        (libc.umount2, (b"/sys", _MNT_DETACH)),
        (libc.mount, (name.encode(), b"/sys", b"sysfs", 0, None)),
    ]
    for call, args in steps:
        if call(*args) != 0:
            raise OSError(ctypes.get_errno(), f"{call.__name__}{args} for network namespace {name} failed")


def in_namespace(name: str, fn: Callable[[], T]) -> T:
    """`fn()` on a new thread that has entered network namespace `name` (setns affects that thread only)."""
    outcome: dict = {}

    def body():
        try:
            enter(name)
            outcome["value"] = fn()
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=body, name=f"gradsync-netns-{name}", daemon=True)
    thread.start()
    thread.join(_JOIN_TIMEOUT_S)
    if thread.is_alive():
        raise TimeoutError(f"{fn} in network namespace {name} took over {_JOIN_TIMEOUT_S:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _delete(namespace: str) -> None:
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=_CMD_TIMEOUT_S)


def remove_abandoned() -> list[str]:
    """Delete the namespaces of every network whose launcher died without removing them (its lease is
    held by no one); returns the namespaces deleted."""
    if not os.path.isdir(LEASES):
        return []
    deleted = []
    for name in sorted(os.listdir(LEASES)):
        lease = os.path.join(LEASES, name)
        if not (name.endswith(".lease") and name.startswith(PREFIX) and abandoned(lease)):
            continue
        job = name[: -len(".lease")]
        for namespace in leftovers():
            if namespace.startswith(job):
                _delete(namespace)
                deleted.append(namespace)
        os.unlink(lease)
    return deleted


def leftovers() -> list[str]:
    """Namespaces named with PREFIX that exist now (none should outlive the job that created them)."""
    return (
        sorted(name for name in os.listdir("/run/netns") if name.startswith(PREFIX))
        if os.path.isdir("/run/netns")
        else []
    )
