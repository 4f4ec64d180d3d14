"""What one parameter server holds, as plain data: what its endpoint tells clients and checks requests against.

`ParameterServer.layout()` makes it under the shard's lock, so that a transport's servicer
(`gradsync.transport.grpc.servicer`) reads names, pieces, tables and limits without reaching into `ShardState`.
"""

from __future__ import annotations

import dataclasses

import torch

from gradsync.core.buckets import Entry


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
