"""Servers lost from a job whose shards have replicas (replicas 1), as the rendezvous store holds them.

When a server dies, its launcher records that its shard is served by the next server, which keeps its replica
(`record_moved`: the SERVED_BY key of that shard); the workers then send that shard's calls there
(`RpcTransport`), the primary whose replica lived on the dead server goes on without one, and the other ranks stop
watching the dead one's heartbeat (`lost`).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from gradsync.core.job_names import StoreKeys


def replica_server(shard: int, servers: int) -> int:
    """The server rank that keeps `shard`'s replica: the next one."""
    return (shard + 1) % servers


def record_moved(store: dist.Store, shard: int, rank: int) -> None:
    """`shard` is served by server `rank` from now on (its own server died)."""
    store.set(StoreKeys.SERVED_BY.format(shard), str(rank))


def moved(store: dist.Store, shard: int, timeout: float = 0.0) -> int | None:
    """The server rank that serves `shard` since its own server died, waiting up to `timeout` seconds for the
    launcher's word; None when there is none."""
    key = StoreKeys.SERVED_BY.format(shard)
    try:
        if timeout > 0:
            store.wait([key], datetime.timedelta(seconds=timeout))
        elif not store.check([key]):
            return None
        return int(store.get(key).decode())
    except dist.DistStoreError:  # no word within the timeout
        return None


def lost(store: dist.Store, servers: int) -> set[int]:
    """The server ranks that died in a job whose shards have replicas (their shards moved)."""
    keys = [StoreKeys.SERVED_BY.format(s) for s in range(servers)]
    return {s for s, key in enumerate(keys) if store.check([key])}
