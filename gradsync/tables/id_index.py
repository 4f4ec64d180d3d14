"""IdIndex: int64 id -> row slot, an open-addressing hash table held in torch tensors, its loops compiled
(`tables/table_loops.c`, built with the package): no Python object per id, tens of nanoseconds an id.

Buckets are three arrays (`keys` int64, `values` int64, `state` int8: empty or full); an id starts at
`mix64(id) & (buckets - 1)` and probes linearly. A removal moves back the ids after it along their probes, so
removals leave nothing behind and the index grows only with the ids it holds: when an insert would fill more
than `MAX_LOAD` of the buckets, the table is rebuilt at the size where its ids fill at most half of that (2 to 4
buckets an id). Every int64 is a valid id, -2**63 and 2**63-1 included.
"""
from __future__ import annotations

import torch

from gradsync.tables import _table_loops

_FULL = 1
MAX_LOAD = 0.5
"""The most of its buckets the index fills before it is rebuilt larger."""


class IdIndex:
    """A set of distinct int64 ids, each with an int64 value (the row slot it holds)."""

    def __init__(self, expected: int = 0):
        self._allocate(_buckets_for(expected))

    def _allocate(self, buckets: int) -> None:
        self.keys = torch.zeros(buckets, dtype=torch.int64)
        self.values = torch.zeros(buckets, dtype=torch.int64)
        self.state = torch.zeros(buckets, dtype=torch.int8)
        self._arrays = (self.keys.numpy(), self.values.numpy(), self.state.numpy())
        self.count = 0

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.state.nbytes

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The value of each id (any shape, int64): -1 where the id is absent."""
        flat = _ids(ids)
        out = torch.empty_like(flat)
        _table_loops.find(*self._arrays, flat.numpy(), out.numpy())
        return out.reshape(ids.shape)

    def insert(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Add distinct ids that are absent, with their values."""
        if not ids.numel():
            return
        if self.count + ids.numel() > MAX_LOAD * self.keys.numel():
            self._rebuild(self.count + ids.numel())
        self._place(_ids(ids), _ids(values))

    def _place(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        _table_loops.insert(*self._arrays, ids.numpy(), values.numpy())
        self.count += ids.numel()

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Drop present ids (absent ones are ignored); the values they held."""
        flat = _ids(ids)
        out = torch.empty_like(flat)
        removed = _table_loops.remove(*self._arrays, flat.numpy(), out.numpy())
        self.count -= removed
        return out[:removed]

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids held and their values, in bucket order."""
        full = self.state == _FULL
        return self.keys[full], self.values[full]

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
