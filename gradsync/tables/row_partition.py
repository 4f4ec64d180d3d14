"""Which worker owns which row of a table under the sharded strategy, and how a batch's ids are sent to their
owners.

Row `r`'s owner among W workers is `mix64(r) mod W` (`tables.id_hash.mix64`, SplitMix64's finaliser, its
64 bits read as an unsigned integer): a fixed function of the id, the same in every process and for every
number of workers, that scatters neighbouring (and popular, low-numbered) ids over the workers. An owner
stores its rows in ascending id order, so a row's local index is its place among the owner's ids
(`local_index`). A lookup's unique ids travel to their owners grouped by owner (`ExchangePlan`).
"""

from __future__ import annotations

import dataclasses

import torch

from gradsync.tables.id_hash import mix64

LOOKUPS_PER_EXCHANGE = 8
"""The most lookups one exchange of ids carries: a forward's lookups wait together (`worker.rows.pending_rows`)
until one of them is used, or this many wait, and then travel in one exchange of ids and one of rows."""
_TWO_64 = 1 << 64
_CHUNK = 1 << 16
"""Ids hashed at a time by `owned_rows`: its temporaries stay a few hundred KB, whatever the table."""


def owners(ids: torch.Tensor, workers: int) -> torch.Tensor:
    """The owner (0 .. workers-1) of each id: `mix64(id)` as an unsigned 64-bit integer, modulo `workers`."""
    h = mix64(ids.long())
    # an int64 holding a negative pattern stands for pattern + 2**64: add 2**64 mod W back to its remainder
    return (torch.remainder(h, workers) + (h < 0).long() * (_TWO_64 % workers)) % workers


def owned_rows(rows: int, worker: int, workers: int) -> torch.Tensor:
    """The ids of the `rows`-row table that `worker` owns, ascending (its local rows 0, 1, ...); hashed a chunk
    at a time, so that building a large table's shard holds no table-sized temporaries."""
    parts = []
    for start in range(0, rows, _CHUNK):
        ids = torch.arange(start, min(start + _CHUNK, rows))
        parts.append(ids[owners(ids, workers) == worker])
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def local_index(owned: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The local indices of `ids` among an owner's `owned` ids (ascending); every id must be owned."""
    return torch.searchsorted(owned, ids)


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """A worker's unique ids grouped by owner: `ids[order]` is what travels, `counts[w]` of them to worker w."""

    order: torch.Tensor
    counts: list[int]

    @classmethod
    def of(cls, ids: torch.Tensor, workers: int) -> ExchangePlan:
        return cls.placed(owners(ids, workers), workers)

    @classmethod
    def placed(cls, owner: torch.Tensor, workers: int) -> ExchangePlan:
        """The plan of ids whose owners are `owner` (a dynamic table's: `tables.id_hash.server_of`)."""
        order = torch.argsort(owner, stable=True)
        return cls(order, torch.bincount(owner, minlength=workers).tolist())
