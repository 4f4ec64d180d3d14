"""The emulated network's addresses (`gradsync run --link`, `gradsync.launcher.netem`), and whether this
network namespace can reach one: shared by the launcher that builds the network and the clients that
connect into it."""

from __future__ import annotations

import ipaddress
import socket

SUBNET = "10.213.0"
HUB_ADDRESS = f"{SUBNET}.1"
NETWORK = ipaddress.ip_network(f"{SUBNET}.0/24")


def reachable(host: str) -> bool:
    """Whether `host` can be reached from this namespace without leaving the machine: true unless it is an
    address of an emulated network and this namespace has no address on it (connecting a UDP socket picks
    the route and the source address without sending anything)."""
    try:
        if ipaddress.ip_address(host) not in NETWORK:
            return True
    except ValueError:  # a name, not an address: not one of ours
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError:  # no route at all
            return False
        return ipaddress.ip_address(probe.getsockname()[0]) in NETWORK
