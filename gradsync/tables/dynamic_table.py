"""DynamicTable: the state of a dynamic embedding table (rows for ids of any int64 value, at most `capacity` of
them after each step), with the admission, creation and eviction rules. Pure tensors in and out, no job: a
server holds one for its shard of the ids, a process training alone holds the whole table.

A step is `lookup(ids, step)` or `count_lookups(distinct ids, occurrences, step)` (any number of times),
`apply(optimizer, slots, grads)`, then `end_step(step)`.

Lookup, for each distinct id of the step's lookups (a sighting is a step in which the id is looked up, once or
many times, by any worker: so the decision at step t depends only on earlier steps and whether the id is looked
up at t, never on how the step's ids were split among workers or in which order they arrived):
  - resident: its slot; the row's last step becomes `step` and its lookup count grows by its occurrences.
  - not resident: this step is its sighting n (sightings are remembered while it waits, starting at 1).
    It is admitted at its first lookup of the step, and its row created with `init(id)` and fresh optimizer
    state (every lookup of the id in that step then reads the row), when
      - n >= `admit_after`, and
      - with `admit_probability` = p: `unit_interval(keyed(id, seed, b"admit", n)) < p` (tables/id_hash.py):
        each sighting from the `admit_after`-th on admits with probability p, the same draw for the same id
        and sighting in every process.
    A created row's lookup count starts at its occurrences in the step (lookups count occurrences, each
    lookup of each worker). A not-admitted id has no slot (-1): it reads zeros and gets no update; its
    occurrences count as `filtered`.
End of step, after the update:
  1. with `ttl_steps` = N, every row whose last step is <= step - N is evicted (not looked up in the last N);
  2. while more than `capacity` rows remain, the smallest by key is evicted: `evict="lru"`: (last step looked
     up, id); `"lfu"`: (lookups since created, last step looked up, id); ids compare as signed int64;
  3. waiting ids are bounded the same way: while more than `capacity` ids wait, the smallest by (last step
     sighted, id) is forgotten (its sightings start again from 0). An evicted id's sightings also restart: it
     is admitted again by the same rule as a new id, with `init(id)` and fresh optimizer state.
So rows and waiting ids each exceed `capacity` only within a step, by that step's new ids.

Checkpoints (`checkpoint`): a full one holds every resident id with its row, last step, lookup count and row
optimizer state, and every waiting id with its sightings and last step; a delta only the rows and waiting ids
changed (looked up, created, updated) since the last full one, with the ids that left since then, and both
restore exactly (`tables.dynamic_checkpoint`, `load`).

Memory: per slot the row, its id, last step and lookup count (24 bytes), changed and held flags (2 bytes), its
place in the stack of free slots (8 bytes) and the row optimizer's state; per waiting id 26 bytes; per id of the
last full checkpoint 8 bytes; each id index 16 bytes per bucket, 2 to 4 buckets per id; each recency log
(`tables.recency_log`: the ids by last step, which LRU eviction, `ttl_steps` and forgetting waiting ids read
instead of every id) 12 bytes an entry, up to 2 per id, and under LFU up to 2 more in the logs by lookup count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradsync.core import huge_pages
from gradsync.tables import _table_loops
from gradsync.tables.id_hash import keyed, unit_interval
from gradsync.tables.id_index import IdIndex
from gradsync.tables.recency_log import RecencyLog
from gradsync.tables.row_init import HashedUniform, checked_init
from gradsync.tables.row_optim import ROW_OPTIMIZERS, LazyRows, RowOptimizer

EVICTION_RULES = ("lru", "lfu")
LFU_LOGS = 16
"""LFU: the lookup counts 0 .. LFU_LOGS each have a recency log, from which eviction takes the rows looked up
least (0: rows loaded without their counts); where it must go beyond them it ranks every row."""
_ADMIT_WORD = 0x61646D6974  # b"admit"
_NEVER = -(1 << 62)  # an arriving id's last step, until it is looked up (sighted)
_NONE = torch.zeros(0, dtype=torch.int64).numpy()  # an absent array of the compiled loops


class DynamicTable:
    """Rows for ids of any int64 value; see the module docstring for the rules. `step` is the next step."""

    def __init__(
        self,
        dim: int,
        *,
        capacity: int,
        init: Callable[[torch.Tensor], torch.Tensor],
        admit_after: int = 1,
        admit_probability: float | None = None,
        evict: str = "lru",
        ttl_steps: int | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        name: str = "dynamic table",
    ):
        _check_settings(
            name,
            dim=dim,
            capacity=capacity,
            admit_after=admit_after,
            admit_probability=admit_probability,
            evict=evict,
            ttl_steps=ttl_steps,
            dtype=dtype,
        )
        self.dim, self.capacity, self.init, self.dtype, self.seed, self.name = dim, capacity, init, dtype, seed, name
        self.admit_after, self.admit_probability = admit_after, admit_probability
        self.evict, self.ttl_steps = evict, ttl_steps
        self.optimizer: RowOptimizer | None = None
        self.optimizer_state: Any = None  # the optimizer's `new_state`: a tensor, `LazyRows` or None
        self.reset()

    def reset(self) -> None:
        """Empty: no rows, no waiting ids, step 0, counters 0, fresh optimizer state."""
        self.rows = _IdColumns(weight=((self.dim,), self.dtype), lookups=((), torch.int64))
        self.waiting = _IdColumns(sightings=((), torch.int64))
        self.by_lookups = [RecencyLog(self.rows.columns, n) for n in range(LFU_LOGS + 1)] if self.evict == "lfu" else []
        self.step = 0
        self.counters = {"admitted": 0, "filtered": 0, "evicted": 0}
        self.optimizer_state = None if self.optimizer is None else self._new_state(self.rows.slots)

    @property
    def weight(self) -> torch.Tensor:
        """The rows by slot (slots of evicted ids hold stale values until reused)."""
        return self.rows.columns["weight"]

    def __len__(self) -> int:
        return len(self.rows)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, -1 where not resident; reads only (evaluation)."""
        return self.rows.index.find(ids)

    def lookup(self, ids: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Each id's slot (same shape as `ids`) at step `step`, counting sightings and lookups and creating the
        admitted ids' rows; -1 where not admitted. With `counts`, `ids` are distinct and id i stands for
        counts[i] lookups (a worker's batch, told to the server that holds its ids). An `init` result of the
        wrong shape or dtype changes nothing."""
        if counts is not None:
            return self.count_lookups(ids, counts, step)
        unique, inverse, counts = torch.unique(ids.reshape(-1), return_inverse=True, return_counts=True)
        return self.count_lookups(unique, counts, step)[inverse].reshape(ids.shape)

    def count_lookups(self, ids: torch.Tensor, occurrences: torch.Tensor, step: int) -> torch.Tensor:
        """`lookup` of distinct `ids`, each looked up `occurrences` times at step `step`: their slots, -1 where
        not admitted. Lookups of one step may come in any number of calls (a replica adds the other workers'
        lookups to its own), and the table ends the step as after one `lookup` of them all."""
        self._check_step(step, "lookup")
        slots = self.find(ids)
        missing = (slots < 0).nonzero().squeeze(1)
        if missing.numel() and self.admit_after == 1 and self.admit_probability is None:  # all admitted
            new_ids = ids[missing]
            slots[missing] = self._create(new_ids, self._initial_rows(new_ids))
        elif missing.numel():
            new_ids = ids[missing]
            admitted, waiting_slots, sightings = self._admission(new_ids, step)
            created = new_ids[admitted]
            rows = self._initial_rows(created)
            if created.numel() < new_ids.numel():
                self._wait(new_ids[~admitted], waiting_slots[~admitted], sightings[~admitted], step)
            if created.numel():
                if len(self.waiting):
                    self.waiting.drop(waiting_slots[admitted & (waiting_slots >= 0)])
                slots[missing[admitted]] = self._create(created, rows)
        self.counters["filtered"] += self.rows.touch(slots, step, occurrences)
        if self.by_lookups:
            self._log_lookups(slots[slots >= 0], step)
        return slots

    def ids_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The ids resident in `slots`."""
        return self.rows.columns["id"][slots]

    def apply(self, optimizer, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """Update the distinct resident `slots` with their `grads` [len(slots), dim] by the row optimizer
        (gradsync.RowSGD or RowAdagrad); its per-slot state starts fresh with each row."""
        self.train_with(optimizer)
        self.rows.mark(slots)
        optimizer.step(self.weight, self.optimizer_state, slots, grads.to(self.dtype))

    def train_with(self, optimizer) -> None:
        """Make `optimizer` (gradsync.RowSGD or RowAdagrad) the table's row optimizer, with fresh state for every
        row, unless it is already (refused when it has another)."""
        if not isinstance(optimizer, ROW_OPTIMIZERS):
            raise TypeError(
                f"{self.name}: a dynamic table is trained by a row optimizer, got "
                f"{type(optimizer).__name__}; pass gradsync.RowSGD(lr=...) or gradsync.RowAdagrad(lr=...)"
            )
        if self.optimizer is None:
            self.optimizer = optimizer
            self.optimizer_state = self._new_state(self.rows.slots)
        elif optimizer != self.optimizer:
            raise ValueError(
                f"{self.name}: trained by {self.optimizer!r}, now given {optimizer!r}; pass the same "
                "row optimizer every step (its per-row state belongs to the first)"
            )

    def end_step(self, step: int) -> None:
        """After step `step`'s update: evict by `ttl_steps` and `capacity`, forget waiting ids beyond capacity."""
        self.expire(step)
        self.evict_ids(self.smallest_rows(len(self.rows) - self.capacity)[0])
        self.forget_ids(self.smallest_waiting(len(self.waiting) - self.capacity)[0])

    def expire(self, step: int) -> None:
        """The local part of ending step `step`: evict by `ttl_steps`; the next step is `step + 1`. The bounds
        by `capacity` follow (`end_step`, or `tables.global_eviction` over the servers' parts of a table)."""
        self._check_step(step, "end_step")
        if self.ttl_steps is not None:
            self._evict(self.rows.log.pop_until(step - self.ttl_steps))
        self.step = step + 1

    def smallest_rows(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids of the `count` resident rows that go first by the eviction rule, in that order, and their
        keys ([count, 2] (last step, id) for "lru"; [count, 3] (lookups, last step, id) for "lfu")."""
        if count <= 0:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2 if self.evict == "lru" else 3, dtype=torch.int64)
        if self.evict == "lru":
            return self.rows.oldest(count)
        found, left = [], count
        for log in self.by_lookups:
            assert log.lookups is not None  # an LFU log's: the rows of one lookup count
            slots, steps, ids = log.oldest(left)
            found.append(torch.stack([torch.full_like(steps, log.lookups), steps, ids], 1))
            left -= slots.numel()
            if not left:
                keyed = torch.cat(found)
                return keyed[:, 2].clone(), keyed
        ids, slots = self.rows.resident()  # rows looked up more than LFU_LOGS times among them: rank every row
        keys = [self.rows.columns["lookups"][slots], self.rows.columns["last_step"][slots], ids]
        chosen = smallest(keys, count)
        for key in reversed(keys):  # in key order: sorted by each key, the first last (stable)
            chosen = chosen[torch.argsort(key[chosen], stable=True)]
        return ids[chosen], torch.stack([k[chosen] for k in keys], dim=1)

    def smallest_waiting(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `count` waiting ids forgotten first, in that order, and their keys [count, 2] (last step, id)."""
        if count <= 0:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64)
        return self.waiting.oldest(count)

    def evict_ids(self, ids: torch.Tensor) -> None:
        """Evict the resident rows of `ids` (counted as evicted)."""
        self.counters["evicted"] += self.rows.drop_ids(ids)

    def forget_ids(self, ids: torch.Tensor) -> None:
        """Forget the sightings of the waiting `ids`."""
        self.waiting.drop_ids(ids)

    def state(self) -> dict[str, torch.Tensor]:
        """The table as tensors: resident ids ascending with their rows, last steps and lookup counts; waiting
        ids ascending with their sightings and last steps; the next step; the counters."""
        return self._state(self.rows.resident(), self.waiting.resident())

    def checkpoint(self, full: bool = True) -> dict[str, torch.Tensor]:
        """`state()` with each row's optimizer state (`optimizer`: [rows] RowAdagrad's sums, [rows, dim]
        RowSGD's momentum, zeros where a row has none yet; absent without state); it becomes the base of the
        next deltas. `full` False: a delta, which holds only the rows and waiting ids changed since the last
        full checkpoint, and in `removed` and `waiting_removed` the ids held then and not now."""
        rows, removed = self.rows.since_full(full)
        waiting, waiting_removed = self.waiting.since_full(full)
        out = self._state(rows, waiting)
        if not full:
            out.update(removed=removed, waiting_removed=waiting_removed)
        slots, state = _ascending(*rows)[1], self.optimizer_state
        if isinstance(state, torch.Tensor):
            out["optimizer"] = state[slots].clone()
        elif isinstance(state, LazyRows):
            held = state.slot[slots].long()
            out["optimizer"] = state.data.new_zeros(slots.numel(), self.dim)
            out["optimizer"][held >= 0] = state.data[held[held >= 0]]
        return out

    def _state(self, rows: tuple[torch.Tensor, torch.Tensor], waiting: tuple[torch.Tensor, torch.Tensor]):
        """`state()` of the rows and waiting ids given as (ids, slots)."""
        ids, slots = _ascending(*rows)
        waiting_ids, waiting_slots = _ascending(*waiting)
        return {
            "ids": ids,
            "weight": self.weight[slots].clone(),
            "last_step": self.rows.columns["last_step"][slots].clone(),
            "lookups": self.rows.columns["lookups"][slots].clone(),
            "waiting_ids": waiting_ids,
            "waiting_sightings": self.waiting.columns["sightings"][waiting_slots].clone(),
            "waiting_last_step": self.waiting.columns["last_step"][waiting_slots].clone(),
            "step": torch.tensor(self.step),
            "counters": torch.tensor([self.counters[k] for k in ("admitted", "filtered", "evicted")]),
        }

    def load(self, state: dict[str, torch.Tensor], optimizer=None) -> None:
        """Replace everything by `state` (the keys of `state()`; only `ids` and `weight` are required: rows
        then count as looked up in the step before `step`, zero lookups). The row optimizer's state starts
        fresh, or with `optimizer` (the table's row optimizer) from `state["optimizer"]` (`checkpoint`)."""
        ids, weight = state["ids"], state["weight"]
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"{self.name}: state 'ids' must be distinct int64 ids in a 1-D tensor, got "
                f"{ids.dtype} of shape {list(ids.shape)}; load a state saved by a dynamic table"
            )
        if tuple(weight.shape) != (ids.numel(), self.dim) or not weight.dtype.is_floating_point:
            raise ValueError(
                f"{self.name}: state 'weight' has shape {list(weight.shape)} and dtype {weight.dtype}; "
                f"expected [{ids.numel()}, {self.dim}] floating rows, one per id"
            )
        self.reset()
        self.step = int(state.get("step", 0))
        counters = state.get("counters", torch.zeros(3, dtype=torch.int64)).tolist()
        self.counters = dict(zip(("admitted", "filtered", "evicted"), counters))
        slots = self.rows.add(ids)
        self.rows.columns["weight"][slots] = weight.to(self.dtype)
        self.rows.columns["last_step"][slots] = state.get("last_step", torch.tensor(self.step - 1))
        self.rows.columns["lookups"][slots] = state.get("lookups", torch.tensor(0))
        if "waiting_ids" in state:
            waiting = self.waiting.add(state["waiting_ids"])
            self.waiting.columns["sightings"][waiting] = state["waiting_sightings"]
            self.waiting.columns["last_step"][waiting] = state["waiting_last_step"]
        for log in [self.rows.log, self.waiting.log, *self.by_lookups]:
            log.rebuild()
        self.optimizer = optimizer or self.optimizer
        self.optimizer_state = None if self.optimizer is None else self._new_state(self.rows.slots)
        saved = state.get("optimizer") if optimizer is not None else None
        if isinstance(self.optimizer_state, torch.Tensor) and saved is not None:
            self.optimizer_state[slots] = saved
        elif isinstance(self.optimizer_state, LazyRows) and saved is not None:
            held = self.optimizer_state.slots(slots)  # may grow `data`: index it after
            self.optimizer_state.data[held] = saved

    def _check_step(self, step: int, call: str) -> None:
        if step < self.step:
            raise ValueError(
                f"{self.name}: {call}(step={step}) after step {self.step - 1} ended; steps only go "
                f"forward: pass step >= {self.step}"
            )

    def _admission(self, ids: torch.Tensor, step: int):
        """For distinct ids not resident, looked up at `step`: which are admitted, the slot of each in `waiting`
        (-1: not waiting) and its sightings counting this step (a later lookup in the same step finds the step
        counted and the same decision)."""
        waiting_slots = self.waiting.index.find(ids)
        held, at = waiting_slots >= 0, waiting_slots.clamp(min=0)
        before = torch.where(held, self.waiting.columns["sightings"][at], 0)
        counted = held & (self.waiting.columns["last_step"][at] == step)
        sightings = torch.where(counted, before, before + 1)
        admitted = sightings >= self.admit_after
        if self.admit_probability is not None:
            draw = unit_interval(keyed(ids, self.seed, _ADMIT_WORD, sightings))
            admitted &= draw < self.admit_probability
        return admitted, waiting_slots, sightings

    def _log_lookups(self, slots: torch.Tensor, step: int) -> None:
        """LFU: the distinct `slots`, just looked up at `step`, into the log of their lookup count (up to
        LFU_LOGS)."""
        counts = self.rows.columns["lookups"][slots]
        low = counts <= LFU_LOGS
        counts, slots = counts[low], slots[low]
        order = torch.argsort(counts)
        sizes = torch.bincount(counts, minlength=LFU_LOGS + 1).tolist()
        for log, part in zip(self.by_lookups, slots[order].split(sizes)):
            if part.numel():
                log.append(part, step)

    def _wait(self, ids: torch.Tensor, slots: torch.Tensor, sightings: torch.Tensor, step: int) -> None:
        """Remember not-admitted ids' sightings (new ones get a slot in `waiting`)."""
        new = slots < 0
        slots = slots.clone()
        slots[new] = self.waiting.add(ids[new])
        self.waiting.columns["sightings"][slots] = sightings
        self.waiting.touch(slots, step)

    def _initial_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """`init(ids)`, checked (before anything changes); None where the init writes them into the rows
        itself (the default's `HashedUniform.write`)."""
        if isinstance(self.init, HashedUniform) and self.init.writes(self.weight):
            return None
        return checked_init(self.init, ids, self.dim, self.dtype, self.name) if ids.numel() else None

    def _create(self, ids: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Rows for the distinct `ids`, with `rows` (None: written by the init) and fresh optimizer state."""
        slots = self.rows.add(ids)
        if rows is None:
            assert isinstance(self.init, HashedUniform)  # the default init writes the rows (`_initial_rows`)
            self.init.write(ids, self.rows.columns["weight"], slots)
        else:
            self.rows.columns["weight"].index_copy_(0, slots, rows)
        if self.optimizer is not None:
            self._fresh_state(slots)
        self.counters["admitted"] += ids.numel()
        return slots

    def _evict(self, slots: torch.Tensor) -> None:
        self.rows.drop(slots)
        self.counters["evicted"] += slots.numel()

    def _new_state(self, slots: int) -> Any:  # a tensor, `LazyRows` or None, as the optimizer keeps its state
        assert self.optimizer is not None  # called once the table has its row optimizer
        return self.optimizer.new_state(slots, self.dim, self.dtype)

    def _fresh_state(self, slots: torch.Tensor) -> None:
        """The row optimizer's state grown to the rows' slots, and fresh for `slots` (rows just created).
        RowAdagrad: one accumulator per slot, reset to its initial value; RowSGD with momentum (LazyRows): the
        slot's momentum row is zeroed and kept for it, so that memory stays bounded by the slots; RowSGD
        without momentum: no state."""
        state, missing = self.optimizer_state, self.rows.slots - _state_slots(self.optimizer_state)
        if isinstance(state, torch.Tensor):
            if missing:
                state = self.optimizer_state = torch.cat([state, self._new_state(missing)])
            state[slots] = self._new_state(slots.numel())
        elif isinstance(state, LazyRows):
            if missing:
                state.slot = torch.cat([state.slot, self._new_state(missing).slot])
            held = state.slot[slots]
            state.data[held[held >= 0].long()] = 0


def _state_slots(state) -> int:
    """How many slots a row optimizer's state covers."""
    return state.numel() if isinstance(state, torch.Tensor) else state.slot.numel() if state is not None else 0


def smallest(keys: list[torch.Tensor], count: int) -> torch.Tensor:
    """Positions of the `count` lexicographically smallest rows of the columns `keys` (the last key unique), in
    no particular order: a partial selection (`kthvalue`) key by key, each on the ties of the one before."""
    candidates = torch.arange(keys[0].numel())
    chosen = []
    for key in keys:
        values = key[candidates]
        if count <= 0 or count >= values.numel():
            break
        threshold = values.kthvalue(count).values
        below = candidates[values < threshold]
        chosen.append(below)
        count -= below.numel()
        candidates = candidates[values == threshold]
    return torch.cat(chosen + [candidates[: max(count, 0)]])


def _ascending(ids: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(ids)
    return ids[order], slots[order]


class _IdColumns:
    """Distinct ids, each in a slot of some columns (tensors with one entry per slot): an `IdIndex` from id to
    slot, a stack of free slots, and columns that double when the slots run out."""

    def __init__(self, **columns: tuple[tuple[int, ...], torch.dtype]):
        self.index = IdIndex()
        columns["id"] = ((), torch.int64)
        columns["changed"] = ((), torch.bool)  # since the last full checkpoint
        columns["held"] = ((), torch.bool)  # the slot holds an id
        columns["last_step"] = ((), torch.int64)  # the step its id was last looked up (sighted), `_NEVER` on arrival
        self.base = torch.zeros(0, dtype=torch.int64)  # the ids held at the last full checkpoint
        self.slots = 64
        self.columns = {
            name: torch.zeros((self.slots,) + shape, dtype=dtype) for name, (shape, dtype) in columns.items()
        }
        self.free = torch.arange(self.slots - 1, -1, -1)  # a stack of the free slots: the next ones at the top,
        self.free_top = self.slots  # `free[:free_top]`; room for every slot, so freeing never copies it
        self.log = RecencyLog(self.columns)

    def __len__(self) -> int:
        return len(self.index)

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for distinct ids not held yet (from the top of the stack of free slots, which grows with the
        columns when it runs short), their lookup counts 0."""
        ids = ids.contiguous()
        if ids.numel() > self.free_top:
            self._grow(ids.numel() - self.free_top)
        slots = torch.empty_like(ids)
        c = self.columns
        self.free_top = _table_loops.claim(
            self.free.numpy(),
            self.free_top,
            ids.numpy(),
            c["id"].numpy(),
            c["changed"].numpy(),
            c["held"].numpy(),
            c["last_step"].numpy(),
            _NEVER,
            c["lookups"].numpy() if "lookups" in c else _NONE,
            slots.numpy(),
        )
        self.index.insert(ids, slots)
        return slots

    def _grow(self, extra: int) -> None:
        """At least `extra` more slots (twice as many at least), free: below the free ones on the stack, so
        that freed slots are taken first."""
        grown = max(self.slots + extra, 2 * self.slots)
        for name, column in self.columns.items():
            self.columns[name] = huge_pages.empty((grown,) + column.shape[1:], column.dtype)
            self.columns[name][: self.slots] = column
            self.columns[name][self.slots :] = 0
        free = huge_pages.empty((grown,), torch.int64)
        torch.arange(grown - 1, self.slots - 1, -1, out=free[: grown - self.slots])
        free[grown - self.slots : grown - self.slots + self.free_top] = self.free[: self.free_top]
        self.free, self.free_top, self.slots = free, grown - self.slots + self.free_top, grown

    def touch(self, slots: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> int:
        """The ids in the distinct `slots` (-1: none, skipped) were looked up (sighted) at `step`: changed
        (`mark`), their last step `step`, in the log once a step; with `counts`, each slot's count added to the
        column `lookups`. Returns the counts of the skipped summed."""
        slots = slots.contiguous()
        fresh = torch.empty_like(slots)
        counted = counts is not None
        fresh_count, skipped = _table_loops.touch(
            self.columns["last_step"].numpy(),
            self.columns["changed"].numpy(),
            self.columns["lookups"].numpy() if counted else _NONE,
            slots.numpy(),
            counts.contiguous().numpy() if counts is not None else _NONE,
            step,
            fresh.numpy(),
        )
        self.log.append(fresh[:fresh_count], step)
        return skipped

    def oldest(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids of the `count` first by (last step, id), in that order, and their keys [count, 2]."""
        _, steps, ids = self.log.oldest(count)
        return ids, torch.stack([steps, ids], dim=1)

    def mark(self, slots: torch.Tensor) -> None:
        """The ids in `slots` changed: the next delta checkpoint holds them."""
        self.columns["changed"].index_fill_(0, slots, True)

    def drop(self, slots: torch.Tensor) -> None:
        """Forget the ids in `slots`; the slots are free for the next ids."""
        self.index.remove(self.columns["id"][slots])
        self._free(slots)

    def drop_ids(self, ids: torch.Tensor) -> int:
        """Forget those of `ids` held (one probe of the index); how many were."""
        slots = self.index.remove(ids)
        self._free(slots)
        return slots.numel()

    def _free(self, slots: torch.Tensor) -> None:
        self.columns["held"].index_fill_(0, slots, False)
        self.free[self.free_top : self.free_top + slots.numel()] = slots
        self.free_top += slots.numel()

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids held and their slots, in slot order."""
        slots = self.columns["held"].nonzero().squeeze(1)
        return self.columns["id"][slots], slots

    def since_full(self, full: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """For a checkpoint: (ids, slots) of every id held (`full`; it becomes the base of the next deltas),
        or of those changed since the last full one, and the ids of that one no longer held."""
        ids, slots = self.resident()
        if full:
            self.base, _ = ids.sort()
            self.columns["changed"].zero_()
            return (ids, slots), ids[:0]
        changed = self.columns["changed"][slots]
        return (ids[changed], slots[changed]), self.base[~torch.isin(self.base, ids)]


def _check_settings(name: str, *, dim, capacity, admit_after, admit_probability, evict, ttl_steps, dtype) -> None:
    """One error naming the first bad setting, its value and what it accepts."""

    def at_least(value, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    bad = (
        ("dim", dim, "an int >= 1")
        if not at_least(dim, 1)
        else ("capacity", capacity, "the most rows the table holds, an int >= 1")
        if not at_least(capacity, 1)
        else ("admit_after", admit_after, "an int >= 1 (1: admit on first sight)")
        if not at_least(admit_after, 1)
        else ("admit_probability", admit_probability, "None or a number in (0, 1]")
        if admit_probability is not None
        and not (isinstance(admit_probability, (int, float)) and 0 < admit_probability <= 1)
        else ("evict", evict, "'lru' or 'lfu'")
        if evict not in EVICTION_RULES
        else ("ttl_steps", ttl_steps, "None or an int >= 1")
        if ttl_steps is not None and not at_least(ttl_steps, 1)
        else ("dtype", dtype, "a floating dtype such as torch.float32")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point)
        else None
    )
    if bad:
        raise ValueError(f"{name}: {bad[0]}={bad[1]!r} is not accepted; pass {bad[2]}")
