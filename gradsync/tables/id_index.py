"""IdIndex: int64 id -> row slot, an open-addressing hash table held in torch tensors, every operation
vectorised over a batch of ids (no Python object per id).

Buckets are three arrays (`keys` int64, `values` int64, `state` int8: empty, full or a tombstone left by a
removal); an id starts at `mix64(id) & (buckets - 1)` and probes linearly. A batch moves through the table
together: each round compares every still-unresolved id with its next `WINDOW` buckets at once and advances
the rest by that many, so a batch costs (longest probe / `WINDOW`) rounds of tensor operations. Removal leaves
a tombstone. When an insert would fill more than `MAX_LOAD` of the buckets (ids and tombstones), the table is
rebuilt without tombstones at the size where its ids fill at most half of that: a rebuild is paid for by as
many inserts as the table then holds. Every int64 is a valid id, -2**63 and 2**63-1 included.
"""
from __future__ import annotations

import torch

from gradsync.tables.id_hash import mix64

_EMPTY, _FULL, _TOMBSTONE = 0, 1, 2
MAX_LOAD = 0.5
"""The most of its buckets the index fills (ids and tombstones) before it is rebuilt."""
WINDOW = 8
"""Buckets of its probe an id is compared with in one round."""
_STEPS = torch.arange(WINDOW)


class IdIndex:
    """A set of distinct int64 ids, each with an int64 value (the row slot it holds)."""

    def __init__(self, expected: int = 0):
        self._allocate(_buckets_for(expected))

    def _allocate(self, buckets: int) -> None:
        self.keys = torch.zeros(buckets, dtype=torch.int64)
        self.values = torch.zeros(buckets, dtype=torch.int64)
        self.state = torch.zeros(buckets, dtype=torch.int8)
        self.count = 0
        self.tombstones = 0

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.state.nbytes

    def _buckets(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's bucket in the table as it stands: -1 where the id is absent."""
        mask = self.keys.numel() - 1
        found = torch.full_like(ids, -1)
        pending, wanted, pos = torch.arange(ids.numel()), ids, mix64(ids) & mask
        while pending.numel():
            window = self._window(pos)
            state = self._at(self.state, window)
            hit = (self._at(self.keys, window) == wanted.unsqueeze(1)) & (state == _FULL)
            stop = hit | (state == _EMPTY)
            first = stop.to(torch.int8).argmax(1, keepdim=True)  # the first stop in the window (0: none or the first)
            found_here = hit.gather(1, first).squeeze(1)
            found.index_copy_(0, pending.masked_select(found_here), window.gather(1, first).squeeze(1)[found_here])
            go_on = ~stop.any(1)
            pending, wanted = pending.masked_select(go_on), wanted.masked_select(go_on)
            pos = (pos.masked_select(go_on) + WINDOW) & mask
        return found

    def _window(self, pos: torch.Tensor) -> torch.Tensor:
        """The `WINDOW` buckets from each of `pos` on, [len(pos), WINDOW]."""
        return (pos.unsqueeze(1) + _STEPS) & (self.keys.numel() - 1)

    @staticmethod
    def _at(column: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        return column.index_select(0, window.view(-1)).view(window.shape)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The value of each id (any shape, int64): -1 where the id is absent."""
        flat = ids.reshape(-1)
        buckets = self._buckets(flat)
        out = torch.where(buckets >= 0, self.values.index_select(0, buckets.clamp(min=0)), -1)
        return out.reshape(ids.shape)

    def insert(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Add distinct ids that are absent, with their values."""
        if not ids.numel():
            return
        if (self.count + self.tombstones + ids.numel()) > MAX_LOAD * self.keys.numel():
            self._rebuild(self.count + ids.numel())
        self._place(ids, values)

    def _place(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Each id into the first non-full bucket along its probe. Where several reach the same free bucket in
        a round, all write their id there and the one whose id reads back takes it; the others probe on from
        the bucket after it."""
        mask = self.keys.numel() - 1
        pending, pos = torch.arange(ids.numel()), mix64(ids) & mask
        while pending.numel():
            window = self._window(pos)
            open_ = self._at(self.state, window) != _FULL
            first = open_.to(torch.int8).argmax(1, keepdim=True)
            free = open_.gather(1, first).squeeze(1).nonzero().squeeze(1)
            tried = window.gather(1, first).squeeze(1).index_select(0, free)  # each free one's open bucket
            at, who = tried, pending.index_select(0, free)
            wanted = ids.index_select(0, who)
            self.keys.index_copy_(0, at, wanted)
            won = self.keys.index_select(0, at) == wanted
            at, who = at.masked_select(won), who.masked_select(won)
            self.tombstones -= int((self.state.index_select(0, at) == _TOMBSTONE).sum())
            self.values.index_copy_(0, at, values.index_select(0, who))
            self.state.index_fill_(0, at, _FULL)
            self.count += who.numel()
            next_pos = pos + WINDOW  # no open bucket in the window: the next one
            next_pos[free] = tried + 1  # lost it: on from the next
            left = torch.ones_like(pending, dtype=torch.bool)
            left[free[won]] = False
            pending, pos = pending.masked_select(left), next_pos.masked_select(left) & mask

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Drop present ids (absent ones are ignored); the values they held."""
        buckets = self._buckets(ids.reshape(-1))
        buckets = buckets.masked_select(buckets >= 0)
        self.state.index_fill_(0, buckets, _TOMBSTONE)
        self.count -= buckets.numel()
        self.tombstones += buckets.numel()
        return self.values.index_select(0, buckets)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids held and their values, in bucket order."""
        full = self.state == _FULL
        return self.keys[full], self.values[full]

    def _rebuild(self, count: int) -> None:
        ids, values = self.items()
        self._allocate(_buckets_for(2 * count))
        self._place(ids, values)


def _buckets_for(count: int) -> int:
    """The fewest buckets, a power of two (64 at least), that hold `count` ids within `MAX_LOAD`."""
    buckets = 64
    while count > MAX_LOAD * buckets:
        buckets *= 2
    return buckets
