"""Every transport by the `transport` setting's value: its worker side, its rank side and its capabilities.

Code outside `gradsync.transport` asks `transport(name)` (or the capabilities table in core), never compares
a transport's name. A transport's module is imported only when it is asked for, so that importing gradsync
loads no grpc.
"""

from __future__ import annotations

import dataclasses

from gradsync.core.transport_capabilities import Capabilities, capabilities
from gradsync.transport.base import RankTransport, WorkerTransport


@dataclasses.dataclass(frozen=True)
class Transport:
    """One registered transport: the class a worker calls the servers with, and its rank side."""

    worker: type[WorkerTransport]
    rank: RankTransport

    @property
    def capabilities(self) -> Capabilities:
        return self.worker.capabilities


def _rpc() -> Transport:
    from gradsync.transport import rpc

    return Transport(rpc.RpcTransport, rpc.RpcRank())


def _grpc() -> Transport:
    from gradsync.transport.grpc import job_calls

    return Transport(job_calls.GrpcTransport, job_calls.GrpcRank())


_LOADERS = {"rpc": _rpc, "grpc": _grpc}


def transport(name: str) -> Transport:
    """The transport the `transport` setting names.

    Raises:
        ValueError: no transport has that name (naming the ones there are).
    """
    capabilities(name)  # refuses an unknown name
    return _LOADERS[name]()


def names() -> tuple[str, ...]:
    """Every registered transport's name."""
    return tuple(_LOADERS)
