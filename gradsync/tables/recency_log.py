"""RecencyLog: the slots of a table's ids in the order of the step at which each was last looked up (or, for
waiting ids, sighted), oldest first, so that LRU eviction, `ttl_steps`, forgetting waiting ids and LFU eviction
among the ids looked up a few times (a log for each count) cost what they touch, not a pass over every id held.

The log is a list of entries (slot, step) in step order: `append` adds one for each slot whose last step has just
become `step` (once per step). An entry stands for its id while the slot still holds an id whose last step is the
entry's step; otherwise it is stale (the id was looked up again at a later step, or left its slot) and a scan
drops the stale entries it passes. Before a scan for the first ids, the entries appended since the last one are
ordered by (step, id) (compiled: a merge of the runs the lookups appended in id order), so the first live entries
are the first ids by the eviction rule's key. When the log runs out of room the stale entries go all at once and
the room doubles over what is left, so the log holds about two entries per id at most and an append costs O(1)
amortised. Memory: 12 bytes an entry (int32 slot, int64 step).
"""

from __future__ import annotations

import numpy
import torch

from gradsync.core import huge_pages
from gradsync.tables import _table_loops

_NO_COUNTS = numpy.zeros(0, dtype=numpy.int64)

MIN_ROOM = 1024
"""Entries the log has room for at least."""


class RecencyLog:
    """The ids held in `columns` (an `_IdColumns`'s, read each time: they are replaced when they grow; `held`
    and `last_step` by slot) by last step; with `lookups` = n, only the ids looked up n times (by the column
    `lookups`): LFU's ranks, one log for each of the first few counts."""

    def __init__(self, columns: dict[str, torch.Tensor], lookups: int | None = None):
        self.columns, self.lookups = columns, lookups
        self.slots = torch.zeros(MIN_ROOM, dtype=torch.int32)
        self.steps = torch.zeros(MIN_ROOM, dtype=torch.int64)
        self.head = self.tail = 0
        self.ordered = 0  # the entries before it are in (step, id) order

    def __len__(self) -> int:
        """Entries, stale ones included."""
        return self.tail - self.head

    def append(self, slots: torch.Tensor, step: int) -> None:
        """Entries for the distinct `slots`, whose last step has just become `step` (no earlier than any
        entry's)."""
        if self.tail + slots.numel() > self.slots.numel():
            self._compact(slots.numel())
        end = self.tail + slots.numel()
        self.slots[self.tail : end] = slots
        self.steps[self.tail : end] = step
        self.tail = end

    def rebuild(self) -> None:
        """Entries for every id held, from the columns (after a load wrote them directly)."""
        held = self.columns["held"]
        if self.lookups is not None:
            held = held & (self.columns["lookups"] == self.lookups)
        slots = held.nonzero().squeeze(1)
        slots = slots[torch.argsort(self.columns["id"][slots])]
        steps = self.columns["last_step"][slots]
        order = torch.argsort(steps, stable=True)
        self._refill(slots[order], steps[order])

    def oldest(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slots of the `count` ids first by (last step, id) (every id held, when fewer), in that order,
        with their last steps and ids. The stale entries before the last one read are dropped (compiled)."""
        if count <= 0:
            return (torch.zeros(0, dtype=torch.int64),) * 3
        self._order()
        out = torch.empty(3, count, dtype=torch.int64)
        c = self.columns
        chosen, self.head = _table_loops.oldest(
            self.slots.numpy(),
            self.steps.numpy(),
            self.head,
            self.tail,
            c["held"].numpy(),
            c["last_step"].numpy(),
            c["lookups"].numpy() if "lookups" in c else _NO_COUNTS,
            -1 if self.lookups is None else self.lookups,
            c["id"].numpy(),
            count,
            *out.numpy(),
        )
        return tuple(out[:, :chosen])

    def pop_until(self, step: int) -> torch.Tensor:
        """The slots of the ids whose last step is `step` or earlier, taken out of the log: the caller lets them
        go."""
        end = self.head + int(torch.searchsorted(self.steps[self.head : self.tail], step, right=True))
        slots, _ = self._live(self.head, end)
        self.head = end
        self.ordered = max(self.ordered, end)
        return slots

    def _order(self) -> None:
        """Order the entries appended since the last time by (step, id), with the earlier ones of their first
        step."""
        if self.ordered >= self.tail:
            return
        first = self.steps[self.ordered : self.ordered + 1]
        start = self.head + int(torch.searchsorted(self.steps[self.head : self.ordered], first))
        _table_loops.order(self.slots.numpy(), self.steps.numpy(), start, self.tail, self.columns["id"].numpy())
        self.ordered = self.tail

    def _live(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots and steps of the entries from `start` to `end` that stand for their ids (int64)."""
        slots = torch.empty(end - start, dtype=torch.int64)
        steps = torch.empty(end - start, dtype=torch.int64)
        c = self.columns
        kept = _table_loops.live(
            self.slots[start:end].numpy(),
            self.steps[start:end].numpy(),
            c["held"].numpy(),
            c["last_step"].numpy(),
            c["lookups"].numpy() if "lookups" in c else _NO_COUNTS,
            -1 if self.lookups is None else self.lookups,
            slots.numpy(),
            steps.numpy(),
        )
        return slots[:kept], steps[:kept]

    def _compact(self, extra: int) -> None:
        """Drop the stale entries; room for `extra` more and as many again as are left."""
        self._order()
        self._refill(*self._live(self.head, self.tail), extra)

    def _refill(self, slots: torch.Tensor, steps: torch.Tensor, extra: int = 0) -> None:
        """The log becomes the entries `slots` with `steps` (in (step, id) order), with room for `extra` more
        and as many again as it holds."""
        room = max(MIN_ROOM, 2 * (slots.numel() + extra))
        if room > self.slots.numel() or 4 * room < self.slots.numel():
            self.slots = huge_pages.empty((room,), torch.int32)
            self.steps = huge_pages.empty((room,), torch.int64)
        self.head, self.tail = 0, slots.numel()
        self.ordered = self.tail
        self.slots[: self.tail] = slots
        self.steps[: self.tail] = steps
