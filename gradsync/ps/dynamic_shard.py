"""One server's part of a dynamic embedding table (`gradsync.DynamicEmbedding` under ps and hybrid): a
`DynamicTable` of the ids that `tables.id_hash.server_of` places on this server, its row optimizer and
counters.

A sync step t, as the workers drive it: each worker's forward looks up its batch's distinct ids here with
their counts (`lookup`: rows as at the start of step t, admitted ids created with `init`); the push's row
gradients, averaged over the workers by the consistency rule, go through `check_push` and `apply`; then every
worker ends the step (`end`, then where the table is over capacity `evict`, and `smallest` where `end`'s
candidates fell short: `tables.global_eviction`). `end` answers the rows and waiting ids held with the first
candidates for eviction here, as many as this server expects to lose: `CANDIDATE_SHARE` x the larger of its
excess over its share of capacity and what it lost at the last step's end, plus `CANDIDATE_MARGIN`; a server
that holds the whole table evicts by itself there. Those three answer the first call of a step and repeat that
answer to the other workers' calls of the same step: the first `end` and `smallest` of step t come before any
`evict` of t and any lookup of t + 1 here (every worker asks every server before it evicts, and evicts before
its next forward), so every worker sees the same keys and evicts the same ids. Callers hold the shard's lock.
The server ends the step itself once every worker's push of it is in, and each push's reply carries `end`'s
answer (`step_end`): a worker calls `end` only where a reply lacks it (a step dropped).

A push (`check_push`, `apply`) finds its rows by a probe of the id index (compiled: tens of nanoseconds an id).

Async and ssp (`alone`): a server steps its part of the table by itself, as no step spans the servers. Its step
counts the pushes it applied: each lookup belongs to the step the server is at (the worker's step is ignored),
and after each push it applies the consistency rule ends the step (`pushed_alone`: `DynamicTable.end_step`, the
rule of the single-process table over this server's ids, bounded by its share of `capacity`:
`capacity // S`, one more on the first `capacity % S` servers, so the whole table holds at most `capacity`).
A push's row gradient goes only to a row resident since the push's lookups (`current`): a row evicted
meanwhile, or evicted and created again (fresh), gets none of it (the version of each row's creation: 8 bytes a slot).
"""

from __future__ import annotations

from typing import cast

import torch

from gradsync.core.errors import GradientError, Refusal
from gradsync.ps.messages import (
    DynamicSetup,
    EndStep,
    Evict,
    FirstToGo,
    LoadTables,
    Lookups,
    ReadRows,
    TableCall,
    TablesCounts,
    TablesState,
    TablesStep,
)
from gradsync.ps.server_table import ServerTable
from gradsync.ps.table_shard import TableStats
from gradsync.tables.dynamic_checkpoint import rehomed
from gradsync.tables.dynamic_table import DynamicTable
from gradsync.tables.id_hash import misplaced, server_of

CANDIDATE_SHARE, CANDIDATE_MARGIN = 1.25, 64
"""How many eviction candidates `end` sends, beyond what it expects to lose (module docstring)."""


class DynamicShard(ServerTable):
    """Server `server`'s ids of dynamic table `name`."""

    answers_calls = True

    def __init__(self, name: str, setup: DynamicSetup, server: int, num_servers: int, alone: bool = False):
        """`alone`: async and ssp, the server ends its steps itself (module docstring)."""
        self.name, self.server, self.num_servers, self.alone = name, server, num_servers, alone
        settings = dict(setup.settings)
        if alone:
            capacity = settings["capacity"]
            settings["capacity"] = capacity // num_servers + (server < capacity % num_servers)
        self.table = DynamicTable(**settings)
        self._created = torch.full((self.table.rows.slots,), -1)  # alone: by slot, the version of its row's creation
        self.optimizer = setup.optimizer
        self.table.train_with(self.optimizer)  # its state in every checkpoint, from the first
        self._stats = TableStats()
        self._ended: tuple[int, tuple] | None = None  # (step, its answer) of the last `end`
        self._smallest: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self._evicted = -1
        self._lost = (0, 0)  # the rows evicted and waiting ids forgotten at the last step's end
        self._loads = 0  # the number of the last worker's module load taken (`load`)
        self._taken: list[dict] = []  # checkpoint parts taken (`take`), restored once complete

    @property
    def stats(self) -> TableStats:
        """The counters, with the rows resident now, their bytes (rows and row optimizer state) and the
        table's admitted / filtered / evicted."""
        t = self.table
        self._stats.rows = len(t)
        self._stats.bytes = len(t) * t.dim * t.dtype.itemsize + self.optimizer.state_bytes(len(t), t.dim, t.dtype)
        self._stats.admitted, self._stats.filtered, self._stats.evicted = (
            t.counters["admitted"],
            t.counters["filtered"],
            t.counters["evicted"],
        )
        return self._stats

    def lookup(
        self, ids: torch.Tensor, counts: torch.Tensor, step: int, version: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s lookups (`alone`: the server's step) of the distinct `ids` (each `counts` times), at the
        shard's `version`: their rows (zeros where not admitted) and which are admitted."""
        self._check_ids(ids, "a lookup")
        if (
            not isinstance(counts, torch.Tensor)
            or counts.dtype != torch.int64
            or counts.shape != ids.shape
            or (counts.numel() and int(counts.min()) < 1)
        ):
            raise GradientError(f"a lookup of dynamic table {self.name!r} needs an int64 count >= 1 per id")
        if not self.alone:
            slots = self.table.lookup(ids, step, counts)
        else:
            absent = self.table.find(ids) < 0
            slots = self.table.lookup(ids, self.table.step, counts)
            grown = self.table.rows.slots - self._created.numel()
            if grown > 0:
                self._created = torch.cat([self._created, self._created.new_full((grown,), -1)])
            self._created[slots[absent & (slots >= 0)]] = version
        self._stats.rows_pulled += ids.numel()
        return self._rows(slots), slots >= 0

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (zeros where not resident), counting nothing: an evaluation forward."""
        self._check_ids(ids, "a read")
        return self._rows(self.table.find(ids))

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        rows = self.table.weight.index_select(0, slots.clamp(min=0))
        absent = (slots < 0).nonzero().squeeze(1)
        return rows.index_fill_(0, absent, 0) if absent.numel() else rows

    def _check_ids(self, ids, what: str, worker: int | str = "a client") -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise GradientError(f"{worker}: {what} of dynamic table {self.name!r} needs a 1-D int64 tensor of ids")
        unordered, elsewhere = misplaced(ids, self.num_servers, self.server)
        if unordered >= 0 and ids.unique().numel() != ids.numel():  # ascending: distinct
            raise GradientError(f"{worker}: {what} of dynamic table {self.name!r} repeats ids: send each once")
        if elsewhere >= 0:
            raise GradientError(
                f"{worker}: id {int(ids[elsewhere])} of dynamic table {self.name!r} is on server "
                f"{int(server_of(ids[elsewhere : elsewhere + 1], self.num_servers))}, not {self.server}"
            )

    def check_push(self, worker: int, ids, grads) -> None:
        """Validate one worker's row gradients: distinct ids of rows resident here, one row of `dim` each."""
        self._check_ids(ids, "a push", f"worker {worker}")
        t = self.table
        if not isinstance(grads, torch.Tensor) or tuple(grads.shape) != (ids.numel(), t.dim) or grads.dtype != t.dtype:
            described = f"{tuple(grads.shape)} {grads.dtype}" if isinstance(grads, torch.Tensor) else type(grads)
            raise GradientError(
                f"worker {worker}: row gradients of dynamic table {self.name!r} are {described}, "
                f"expected {(ids.numel(), t.dim)} {t.dtype}"
            )
        absent = ids[self.table.find(ids) < 0]
        if absent.numel() and not self.alone:  # alone: evicted since the lookup (`current`)
            raise GradientError(
                f"worker {worker}: a push of dynamic table {self.name!r} has id {int(absent[0])}, "
                "which is not resident: push only the ids its lookups admitted this step"
            )

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One row optimizer step on the resident `ids` (distinct) with their averaged gradients."""
        if ids.numel():
            self.table.apply(self.optimizer, self.table.find(ids), grads)
            self._stats.rows_pushed += ids.numel()

    def current(self, version: int, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Alone: of a push's row gradients from lookups at `version` on, those of rows resident since then
        (not evicted, nor created again after an eviction, meanwhile)."""
        slots = self.table.find(ids)
        held = (slots >= 0) & (self._created[slots.clamp(min=0)] <= version)
        return ids[held], grads[held]

    def pushed_alone(self) -> None:
        """Alone: end the server's step after a push it applied (eviction over its share of `capacity`)."""
        if self.alone:
            self.table.end_step(self.table.step)

    def next_end(self) -> int | None:
        return None if self.alone else self.table.step

    def end(self, step: int) -> tuple:
        """End step `step` here (`ttl_steps`; one server: the bounds by capacity too); (resident rows, waiting
        ids, the first candidate rows to evict with their keys, the first waiting ids with theirs) after it,
        the same to every call."""
        if self._ended is None or self._ended[0] != step:
            t = self.table
            t.expire(step)
            if self.num_servers == 1:
                self.evict(
                    step, t.smallest_rows(len(t) - t.capacity)[0], t.smallest_waiting(len(t.waiting) - t.capacity)[0]
                )
            rows, waiting = len(t), len(t.waiting)
            self._ended = (
                step,
                (
                    rows,
                    waiting,
                    *t.smallest_rows(self._candidates(rows, self._lost[0])),
                    *t.smallest_waiting(self._candidates(waiting, self._lost[1])),
                ),
            )
        return self._ended[1]

    def _candidates(self, held: int, lost: int) -> int:
        """How many of its `held` rows (or waiting ids) `end` sends as candidates for eviction."""
        share = -(-self.table.capacity // self.num_servers)
        if held <= share and not lost:
            return 0
        return min(held, int(CANDIDATE_SHARE * max(held - share, lost)) + CANDIDATE_MARGIN)

    def smallest(self, step: int, rows: int, waiting: int) -> tuple[torch.Tensor, ...]:
        """The `rows` rows and `waiting` waiting ids that go first here at the end of step `step`, with their
        keys: (ids, keys, waiting ids, keys); the first call's answer to every call of the step."""
        if self._smallest is None or self._smallest[0] != step:
            self._smallest = (step, self.table.smallest_rows(rows) + self.table.smallest_waiting(waiting))
        return self._smallest[1]

    def checkpoint(self, full: bool = True) -> dict:
        """The table's checkpoint part (`DynamicTable.checkpoint`: full, or a delta since the last full one)
        with the server and number of servers holding it."""
        return {**self.table.checkpoint(full), "server": self.server, "num_servers": self.num_servers}

    def restore(self, parts: list[dict]) -> None:
        """Take this server's ids of the table, with their rows, row optimizer state and admission and eviction
        state, from the checkpoint parts of every server that held it (`complete`), in any order."""
        if parts[0]["num_servers"] == self.num_servers:
            state = next(p for p in parts if p["server"] == self.server)
        else:
            state = rehomed(sorted(parts, key=lambda p: p["server"]), self.server, self.num_servers)
        self.table.load(state, self.optimizer)
        self._created = torch.full((self.table.rows.slots,), -1)  # every row created before any lookup to come

    def load(self, number: int, state: dict) -> None:
        """A worker's `load_state_dict` of the whole table (`state`, its module's state-dict form): this server's
        ids of it, fresh row optimizer state (as a `DynamicEmbedding` in one process). Taken once per `number`:
        every worker sends the same load, and a later one must not undo the lookups made since."""
        if number > self._loads:
            self._loads = number
            self.table.load(rehomed([state], self.server, self.num_servers))
            self._created = torch.full((self.table.rows.slots,), -1)
            self._ended = self._smallest = None  # the steps to come may repeat the steps of these answers
            self._evicted, self._lost = self.table.step - 1, (0, 0)

    def take(self, saved: dict) -> None:
        if "ids" in saved:  # a fixed table's part holds none
            self._taken.append(saved)

    def complete(self) -> bool:
        return self.holds_all(self._taken)

    def missing(self) -> str:
        return (
            f"{len(self._taken)} servers' parts of dynamic table {self.name!r}, not every part that server "
            f"{self.server} needs"
        )

    def restored(self) -> None:
        self.restore(self._taken)
        self._taken = []

    def holds_all(self, parts: list[dict]) -> bool:
        """Whether `parts` hold all of this server's ids: every old server's part, or with the same number of
        servers this server's own."""
        return bool(parts) and (
            len(parts) == parts[0]["num_servers"]
            or (parts[0]["num_servers"] == self.num_servers and any(p["server"] == self.server for p in parts))
        )

    def evict(self, step: int, ids: torch.Tensor, waiting: torch.Tensor) -> None:
        """Evict the rows `ids` and forget the waiting `waiting` for step `step`, once: later calls of the same
        step, and late ones of an earlier step (a worker that left `trainer.join()` sends its last step's when it
        next calls), change nothing."""
        if step > self._evicted:
            evicted = self.table.counters["evicted"]
            self.table.evict_ids(ids)
            self.table.forget_ids(waiting)
            self._evicted = step
            self._lost = (self.table.counters["evicted"] - evicted, int(waiting.numel()))


def held(tables: dict[str, DynamicShard], name: str, holder: str) -> DynamicShard:
    """`holder`'s part of dynamic table `name` (of its `tables`), refused when it holds none."""
    if name not in tables:
        raise Refusal(f"{holder} holds no dynamic table {name!r} (it holds {sorted(tables)})")
    return tables[name]


def step_end(tables: dict[str, ServerTable]) -> tuple[int, dict] | None:
    """Sync, once every worker's push of the step is in (applied or skipped): (the step the tables that end steps
    among `tables` are at, `end`'s answer to it by table), which the push's reply carries to every worker in
    place of its `end` call; None without such tables (or under async and ssp: `alone`)."""
    ending = {n: t for n, t in tables.items() if t.next_end() is not None}
    steps = {t.next_end() for t in ending.values()}
    if len(steps) != 1:
        return None
    step = steps.pop()
    assert step is not None  # `ending` holds the tables that end a step
    # only a dynamic table ends steps (`ServerTable.next_end`)
    return step, {n: cast(DynamicShard, t).end(step) for n, t in ending.items()}


def respond(tables: dict[str, DynamicShard], call: TableCall, holder: str, version: int = 0):
    """`holder`'s answer to `call` on its parts of dynamic tables (`tables`, by name; `version`: the holder's, which
    a lookup answers with): each `TableCall` says what it answers."""
    match call:
        case Lookups(lookups, step, evictions, _):
            if evictions is not None:
                respond(tables, evictions, holder)
            return version, [
                held(tables, name, holder).lookup(ids, counts, step, version) for name, ids, counts in lookups
            ]
        case ReadRows(table, ids):
            return held(tables, table, holder).read(ids)
        case EndStep(step):
            return {n: t.end(step) for n, t in tables.items()}
        case FirstToGo(step, counts):
            return {n: held(tables, n, holder).smallest(step, *ask) for n, ask in counts.items()}
        case Evict(step, plan):
            for n, (ids, waiting) in plan.items():
                held(tables, n, holder).evict(step, ids, waiting)
            return None
        case LoadTables(number, states):
            for n, state in states.items():
                held(tables, n, holder).load(number, state)
            return None
        case TablesState():
            return {n: t.table.state() for n, t in tables.items()}
        case TablesStep():
            return {n: t.table.step for n, t in tables.items()}
        case TablesCounts():
            return {
                n: (len(t.table), [t.table.counters[k] for k in ("admitted", "filtered", "evicted")])
                for n, t in tables.items()
            }
    raise Refusal(f"{holder} got {call!r}, which is no call on dynamic tables (ps.messages.TableCall)")
