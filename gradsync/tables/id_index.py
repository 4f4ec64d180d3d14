"""IdIndex: int64 id -> row slot, an open-addressing hash table held in torch tensors, its loops compiled
(`tables/table_loops.c`, built with the package): no Python object per id, tens of nanoseconds an id.

The buckets are one int64 array of (id, value) pairs, value -1 where empty (values are slots, >= 0), so that a
probe reads one cache line: 16 bytes a bucket. An id starts at `mix64(id) & (buckets - 1)` and probes linearly.
A removal moves back the ids after it along their probes, so removals leave nothing behind and the index grows
only with the ids it holds: when an insert would fill more than `MAX_LOAD` of the buckets, the table is rebuilt
at the size where its ids fill at most half of that (2 to 4 buckets an id). Every int64 is a valid id, -2**63
and 2**63-1 included.
"""

from __future__ import annotations

import torch

from gradsync.core import huge_pages
from gradsync.tables import _table_loops

MAX_LOAD = 0.5
"""The most of its buckets the index fills before it is rebuilt larger."""


class IdIndex:
    """A set of distinct int64 ids, each with an int64 value (the row slot it holds)."""

    def __init__(self, expected: int = 0):
        self._allocate(_buckets_for(expected))

    def _allocate(self, buckets: int) -> None:
        self.buckets = huge_pages.empty((buckets, 2), torch.int64).fill_(-1)
        self._buckets = self.buckets.numpy()
        self.count = 0

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.buckets.nbytes

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The value of each id (any shape, int64): -1 where the id is absent."""
        flat = _ids(ids)
        out = torch.empty_like(flat)
        _table_loops.find(self._buckets, flat.numpy(), out.numpy())
        return out.reshape(ids.shape)

    def insert(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Add distinct ids that are absent, with their values (>= 0)."""
        if not ids.numel():
            return
        if self.count + ids.numel() > MAX_LOAD * self.buckets.shape[0]:
            self._rebuild(self.count + ids.numel())
        self._place(_ids(ids), _ids(values))

    def _place(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        _table_loops.insert(self._buckets, ids.numpy(), values.numpy())
        self.count += ids.numel()

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Drop present ids (absent ones are ignored); the values they held."""
        flat = _ids(ids)
        out = torch.empty_like(flat)
        removed = _table_loops.remove(self._buckets, flat.numpy(), out.numpy())
        self.count -= removed
        return out[:removed]

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids held and their values, in bucket order."""
        full = self.buckets[:, 1] >= 0
        return self.buckets[full, 0], self.buckets[full, 1]

    def _rebuild(self, count: int) -> None:
        ids, values = self.items()
        self._allocate(_buckets_for(2 * count))
        self._place(ids, values)


def _ids(ids: torch.Tensor) -> torch.Tensor:
    """`ids` as the compiled loops read them: a flat, contiguous int64 tensor."""
    return ids.reshape(-1).to(torch.int64).contiguous()


def _buckets_for(count: int) -> int:
    """The fewest buckets, a power of two (64 at least), that hold `count` ids within `MAX_LOAD`."""
    buckets = 64
    while count > MAX_LOAD * buckets:
        buckets *= 2
    return buckets
