"""What one parameter server holds, as plain data: what its endpoint tells clients and checks requests against.

`ParameterServer.layout()` makes it under the shard's lock, so that a transport's servicer
(`gradsync.transport.grpc.servicer`) reads names, pieces, tables and limits without reaching into `ShardState`.
"""
from __future__ import annotations

import dataclasses

import torch

from gradsync.core.buckets import Entry
from gradsync.ps.shard import ShardState
from gradsync.ps.table_shard import TableShard


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """One embedding table's rows on this server."""

    shape: tuple[int, ...]  # the whole table's
    dtype: torch.dtype
    num_servers: int
    rows: int  # rows this server holds


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One server's shard: its names by kind, the pieces of split parameters, its tables, and its sizes."""

    shard_id: int
    version: int
    params: list[str]  # bucket entries' keys (a split parameter's piece as `name[start:end]`)
    frozen: list[str]
    buffers: list[str]
    tables: dict[str, TableLayout]
    pieces: list[Entry]  # the entries that hold part of a parameter
    buckets: int
    nbytes: int  # buckets and buffers: the most a push may carry

    @property
    def names(self) -> list[str]:
        """Every name a pull may ask for."""
        return self.params + self.buffers + self.frozen + list(self.tables)


def layout_of(shard: ShardState) -> ShardLayout:
    """The layout of a `ShardState` (call with its lock held)."""
    return ShardLayout(
        shard_id=shard.shard_id, version=shard.version, params=list(shard.params), frozen=list(shard.frozen),
        buffers=list(shard.buffers),
        tables={n: TableLayout(tuple(t.spec.shape), t.spec.dtype, t.num_servers, t.rows)
                for n, t in shard.tables.items() if isinstance(t, TableShard)},  # a dynamic table has no rows by index
        pieces=[e for b in shard.buckets for e in b.entries if not e.whole], buckets=len(shard.buckets),
        nbytes=sum(b.nbytes for b in shard.buckets) + sum(b.nbytes for b in shard.buffers.values()),
    )
