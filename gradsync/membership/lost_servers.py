"""Where each shard of a job with replicas (replicas 1) is served and kept, as the rendezvous store holds it.

Shard s starts served by server s (its primary) and kept by the next server (its replica). When a server dies, its
launcher records, for each shard it served, that its replica serves it now (`record_primary`), for each shard it
kept, that it has no replica (`record_replica`), then the dead process by its RPC name (`record_dead`): a worker
whose call failed then reads where its shard went, a primary whose replica died goes on alone. A dead server's
replacement copies every shard left without a replica from its primary and keeps its replica from then on
(`replicas_kept`, which its launcher waits for).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from gradsync.core.job_names import StoreKeys, server_name


def replica_server(shard: int, servers: int) -> int:
    """The server rank that keeps `shard`'s replica at the start: the next one."""
    return (shard + 1) % servers


def primary(store: dist.Store, shard: int) -> str:
    """The RPC name of the server that serves `shard` now."""
    key = StoreKeys.SHARD_PRIMARY.format(shard)
    return store.get(key).decode() if store.check([key]) else server_name(shard)


def record_primary(store: dist.Store, shard: int, name: str) -> None:
    store.set(StoreKeys.SHARD_PRIMARY.format(shard), name)


def replica(store: dist.Store, shard: int, servers: int) -> str | None:
    """The RPC name of the server that keeps `shard`'s replica now; None: it has none."""
    key = StoreKeys.SHARD_REPLICA.format(shard)
    if not store.check([key]):
        return server_name(replica_server(shard, servers))
    return store.get(key).decode() or None


def record_replica(store: dist.Store, shard: int, name: str | None) -> None:
    store.set(StoreKeys.SHARD_REPLICA.format(shard), name or "")


def record_dead(store: dist.Store, name: str) -> None:
    """The process of RPC name `name` died: a server's (record where its shards went first), or in a job with
    replicas a worker's (a joining process takes it off torch's list of members: `transport.rpc_group`)."""
    store.set(StoreKeys.SERVER_DEAD.format(name), "1")


def dead(store: dist.Store, name: str, timeout: float = 0.0) -> bool:
    """Whether the process of RPC name `name` (`record_dead`) died, waiting up to `timeout` seconds for its
    launcher's word."""
    key = StoreKeys.SERVER_DEAD.format(name)
    try:
        if timeout > 0:
            store.wait([key], datetime.timedelta(seconds=timeout))
        return store.check([key])
    except dist.DistStoreError:  # no word within the timeout
        return False


def record_kept(store: dist.Store, rank: int, replacement: int, shards: list[int]) -> None:
    """The `replacement`-th process of server `rank` keeps the replicas of `shards` now."""
    store.set(StoreKeys.REPLICAS_KEPT.format(rank), f"{replacement}:{','.join(map(str, shards))}")


def replicas_kept(store: dist.Store, rank: int, replacement: int) -> list[int] | None:
    """The shards the `replacement`-th process of server `rank` keeps the replicas of, once it does; else None."""
    key = StoreKeys.REPLICAS_KEPT.format(rank)
    if not store.check([key]):
        return None
    number, _, shards = store.get(key).decode().partition(":")
    return [int(s) for s in shards.split(",") if s] if int(number) == replacement else None
