"""Worker side of embedding tables split across the workers by row (the sharded strategy), over all-to-all.

Every worker owns the rows `tables.row_partition` gives it and stores only those, with their row optimizer
state. A lookup with gradients returns at once a `PendingRows` (worker.rows.pending_rows) and waits with the
forward's other lookups until one of them is used (or `BATCH` wait, or the forward ends): then every waiting
lookup sends its batch's unique ids to their owners and gets their rows back together, in two
`all_to_all_single` exchanges among the workers (how many ids each lookup sends each worker, with a flag for
an id out of its table, and the first ids of each block; every lookup's rows, as bytes: tables may differ in
dim and dtype), after which each lookup runs (`ServedTables._embed`) on its rows as a leaf. So a forward of
T tables used together makes 2 exchanges, not 2T, as TorchRec's collection modules do, with the user's model
unchanged. The first exchange is tagged and of one size for every worker: each block carries up to
`capacity` ids, zero-padded, which every worker grows alike to the largest block any worker has sent (at most
`ID_CAPACITY`); when some worker's block did not fit, one more exchange carries the rest of every block (a
job's first lookups, a batch larger than any before). Each lookup keeps the route its ids took (`_Route`: the
plan, and on the owner the local rows each worker asked for), so at the step each worker sends its rows'
gradients back along it, with no ids and no counts: one exchange of flags for the whole step (a NaN/Inf in
some worker's row gradients, how many lookups it made), then one of the gradients of every lookup; an owner
sums what every worker sent, divides by W (DDP's mean) and applies the row optimizer. Every exchange is a
collective: every worker makes it, in model order, with or without ids (an empty batch sends and receives
only the tagged exchange). So every worker knows of an out-of-range id or a NaN/Inf row gradient on any
worker and refuses together, before anything is looked up or applied. The tagged exchanges (a batch of
lookups, the end of a forward, which every forward with gradients ends with, the step's flags) carry the
exchange each worker is at (a batch's: its tables in order): a worker whose forward skipped a table, or
looked up another, makes every worker raise at once, naming the tables, where it would otherwise pair
unrelated exchanges (they are of one size, so such a pair still completes). With 4 tables used together a
step makes 5 exchanges (the lookups' 2, the forward's end, the flags, the gradients) besides DDP's allreduce;
TorchRec's table-wise plan makes 5 too.

A dynamic table's lookups (`worker.rows.sharded_dynamic`) go at once (after the waiting ones) along `route`, tagged
like a table's: (id, count) rows out, which the owner's `DynamicShard` answers; their gradients come back with
the fixed tables' at the step, keyed by id.

The whole tables (`trainer.state_dict()`, and the user's module's `state_dict()`, as under ps) are gathered
over torch RPC: each owner answers with its rows once it has applied as many steps as the asking worker,
so a worker that gathers alone (worker 0 saving the model) gets one consistent step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from gradsync.core.errors import bad_id_error
from gradsync.core.finite import first_nonfinite
from gradsync.core.job_names import worker_name
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.tables.placement import TableModule, check_id_dtype, check_ids, merge_rows, out_of_range
from gradsync.tables.row_optim import RowOptimizer, saved_state, take_saved_state
from gradsync.tables.row_partition import LOOKUPS_PER_EXCHANGE as BATCH
from gradsync.tables.row_partition import ExchangePlan, local_index, owned_rows, owners
from gradsync.worker.module.plain_module import check_gatherable
from gradsync.worker.rows.pending_rows import resolved
from gradsync.worker.rows.served_tables import ServedTables

_STEP, _FORWARD_END, _NONE = -1, -2, -3
"""The tags of the step's exchange of flags and of a forward's end (`ShardedTables._meta`); a lookup's is its
table's index; `_NONE` pads a block's list of tags."""

HEADER = 2 * BATCH + 5
"""The int64s ahead of the ids in a tagged exchange's block for each worker (`ShardedTables._meta`): how many
tags, the tags (`BATCH`, padded), an int per tag (a lookup's id elements for this worker), a flag with two ints
(a bad id: the id and its lookup; a NaN/Inf gradient: its lookup), the sender's largest block for any worker."""

ID_CAPACITY = 4096
"""The most id elements (int64) a tagged exchange carries per worker: beyond it, a lookup's ids that do not
fit always take a second exchange, rather than every tagged exchange padding to a rare large batch."""

_HELD: ShardedTables | None = None
"""This worker's tables, which `_rows_of` answers the other workers' gathers from (torch RPC calls a function
by its module path)."""


@dataclasses.dataclass
class _Shard:
    """A worker's rows of one table: their ids (ascending), values and row optimizer state."""

    owned: torch.Tensor
    values: torch.Tensor
    state: Any  # what `optimizer.new_state` made, which its `step` takes: `LazyRows`, a tensor or None
    optimizer: RowOptimizer
    group: int | None  # the optimizer group whose learning rate the rows follow (an exact row form), or None


@dataclasses.dataclass(frozen=True)
class _Route:
    """Where a lookup's unique ids went, which its gradients take back at the step: this worker's `plan`,
    how many ids each worker asked this one for (`asked_counts`) and their rows' keys here (`asked`: local rows
    of a fixed table, ids of a dynamic one)."""

    plan: ExchangePlan
    asked_counts: list[int]
    asked: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Ask:
    """A lookup of table `name` to make: `sent` (a row per unique id, grouped by owner as `plan` says), the
    owner's `answer` (what it was sent -> the rows' keys there, their values), an id of this worker's batch
    outside the table (`bad`), refused on every worker."""

    name: str
    sent: torch.Tensor
    plan: ExchangePlan
    answer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    bad: int | None = None


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """All-to-all of variable-size blocks of rows: `send_counts[w]` rows of `send` to worker w, `recv_counts[w]`
    rows from it, in worker order. Every worker must call it."""
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts)
    return out


def _answer(shard: _Shard, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An owner's side of a lookup of a fixed table: the local rows of the ids `asked` and their values."""
    local = local_index(shard.owned, asked)
    return local, shard.values.index_select(0, local)


def _rows_of(table: str, step: int, timeout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RPC handler: this worker's rows of `table` (ids, values) once it has applied `step` steps."""
    assert _HELD is not None  # a worker with sharded tables answers it
    return _HELD.rows_of(table, step, timeout)


def _rows_at(table: str, ids: torch.Tensor, step: int, timeout: float) -> torch.Tensor:
    """RPC handler: this worker's rows `ids` of `table` once it has applied `step` steps."""
    assert _HELD is not None  # a worker with sharded tables answers it
    return _HELD.rows_of(table, step, timeout, ids)[1]


class ShardedTables(ServedTables):
    """The model's row-wise tables (`choice.choose_tables`), split by row across the workers."""

    def __init__(
        self,
        tables: dict[str, TableModule],
        rows: dict[str, tuple],
        worker: int,
        workers: int,
        timeout: float,
        metrics: StepMetrics,
        dynamic: Iterable[str] = (),
    ):
        """`dynamic`: the names of the model's dynamic tables, whose lookups go along `route` too
        (`worker.rows.sharded_dynamic`)."""
        super().__init__(tables, workers, metrics, None)
        self.worker, self.workers, self.timeout = worker, workers, timeout
        self.rows = rows
        self.looked_up = [spec.name for spec in self.specs] + list(dynamic)  # by exchange tag
        self._index = {name: i for i, name in enumerate(self.looked_up)}
        self.shards: dict[str, _Shard] = {}
        self.applied = 0  # steps applied to this worker's rows (skipped ones included)
        self.capacity = 0  # id elements per worker in every tagged exchange (`_meta`): the same on every worker
        self._stepped = threading.Condition()

    def take_rows(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Keep this worker's rows of each table of worker 0's `weights` (by table; a collective), with a fresh
        row optimizer state; this worker then answers the others' gathers."""
        global _HELD
        for spec in self.specs:
            owned = owned_rows(spec.shape[0], self.worker, self.workers)
            optimizer, group = self.rows[spec.name]
            values = self._scatter(spec, weights[spec.name], self.modules[spec.name].padding_idx, owned)
            self.shards[spec.name] = _Shard(
                owned, values, optimizer.new_state(owned.numel(), spec.shape[1], spec.dtype), optimizer, group
            )
        _HELD = self

    def _scatter(self, spec, weight: torch.Tensor, padding_idx: int | None, owned: torch.Tensor) -> torch.Tensor:
        """This worker's rows of worker 0's `weight` (a collective); a table built on the meta device is
        initialised here instead, N(0, 1) as nn.Embedding does (seeded by the table's name and the worker)."""
        weight = weight.detach()
        if weight.is_meta:
            generator = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()) + self.worker)
            values = torch.randn(owned.numel(), spec.shape[1], generator=generator, dtype=spec.dtype)
            if padding_idx is not None and bool((owned == padding_idx).any()):
                values[local_index(owned, torch.tensor([padding_idx]))] = 0
            return values
        if self.worker == 0:
            owner = owners(torch.arange(spec.shape[0]), self.workers)
            parts = [weight[owner == w] for w in range(self.workers)]
            send, counts = torch.cat(parts), [p.shape[0] for p in parts]
        else:
            send, counts = weight.new_empty((0, spec.shape[1])), [0] * self.workers
        return _exchange(send, counts, [owned.numel() if w == 0 else 0 for w in range(self.workers)])

    def _all_to_all(
        self, what: str, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """`_exchange`, counted in the step's metrics as exchange time and the bytes that went to and came from
        the other workers (a worker's block to itself stays in memory), and recorded as the lane
        `what` of the step timeline."""
        left, started = time.time(), time.perf_counter()
        out = _exchange(send, send_counts, recv_counts)
        row = send.element_size() * math.prod(send.shape[1:])
        sent = row * (sum(send_counts) - send_counts[self.worker])
        got = row * (sum(recv_counts) - recv_counts[self.worker])
        self.metrics.exchanged(time.perf_counter() - started, sent, got)
        self.metrics.timeline.all_to_all(what, sent, got, left)
        return out

    def _meta(
        self,
        tags: list[int],
        ints: list[list[int]],
        flag: tuple[int, int, int],
        lane: str,
        blocks: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Send worker w the ints `ints[w]` (one per tag), `flag` (set, value, index) and the first `capacity`
        elements of `blocks[w]` (a batch of lookups' ids for it; none for the other exchanges), tagged with the
        exchange each worker is at (`tags`: the tables of a batch of lookups, in order; [`_STEP`];
        [`_FORWARD_END`]), as lane `lane`; every worker must call it, and all at the same exchange. Returns each
        worker's ints for this one (W x `BATCH`), its flag with its largest block for any worker (W x 4), and
        the ids it sent this one (W x the capacity before the call, zero-padded). The capacity then grows to
        the largest block of any worker (at most `ID_CAPACITY`), the same on every worker.

        Raises:
            RuntimeError: another worker is at another exchange (a forward that skipped a table, or looked
                one up where this worker did not), naming both and the fix; that worker raises it too.
        """
        capacity, flags = self.capacity, 1 + 2 * BATCH
        meta = torch.zeros(self.workers, HEADER + capacity, dtype=torch.int64)
        meta[:, 0] = len(tags)
        meta[:, 1 : 1 + BATCH] = torch.tensor(tags + [_NONE] * (BATCH - len(tags)))
        meta[:, 1 + BATCH : 1 + BATCH + len(tags)] = torch.tensor(ints, dtype=torch.int64).view(self.workers, -1)
        meta[:, flags : flags + 3] = torch.tensor(flag)
        meta[:, flags + 3] = max((block.numel() for block in blocks), default=0)
        for w, block in enumerate(blocks):
            head = block[:capacity]
            meta[w, HEADER : HEADER + head.numel()] = head
        theirs = self._all_to_all(lane, meta, [1] * self.workers, [1] * self.workers)
        self.capacity = max(capacity, min(ID_CAPACITY, int(theirs[:, flags + 3].max())))
        if (other := (theirs[:, : 1 + BATCH] != meta[0, : 1 + BATCH]).any(1).nonzero().view(-1)).numel():
            w = int(other[0])
            raise RuntimeError(
                f"worker {self.worker} is at {self._tag(tags)} and worker {w} at "
                f"{self._tag(theirs[w, 1 : 1 + int(theirs[w, 0])].tolist())}: every worker must look up every "
                "sharded table in every forward, in the same order (each lookup is an exchange with every worker); "
                "call a table with an empty batch where a worker has no ids for it (nothing was looked up or "
                "applied)"
            )
        return theirs[:, 1 + BATCH : 1 + 2 * BATCH], theirs[:, flags : flags + 4], theirs[:, HEADER:]

    def _tag(self, tags: list[int]) -> str:
        """The exchange tagged `tags`, in words."""
        if tags in ([_STEP], [_FORWARD_END]):
            return {_STEP: "trainer.step", _FORWARD_END: "the end of a forward"}[tags[0]]
        names = ", ".join(repr(self.looked_up[at]) for at in tags)
        return f"a lookup of table{'s' if len(tags) > 1 else ''} {names}"

    def forward_ended(self, module: nn.Module, inputs, output):
        """Forward hook of the user's module: after a forward with gradients, its waiting lookups fetched, every
        worker agrees that its forward is over (a collective), and the lookups' results in the output are made
        real. A worker whose forward skipped a table the others look up last raises here, at once, with them,
        where it would otherwise meet them only at DDP's allreduce, a mismatch gloo reports after the process
        group's timeout."""
        if not torch.is_grad_enabled():
            return None
        self.flush()
        self._meta([_FORWARD_END], [[0]] * self.workers, (0, 0, 0), "forward end")
        return resolved(output)

    def _check(self, name: str, ids: torch.Tensor, rows: int) -> None:
        check_id_dtype(name, ids)  # the range is checked by every worker together, in `flush`

    def _pull(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        """A lookup without gradients (evaluation, which one worker may run alone, say worker 0 after
        training): the rows read without a collective (`_read`), with no route."""
        return self._read(name, ids), None

    def _fetch(self, waiting) -> list[tuple[torch.Tensor, _Route]]:
        """The rows of waiting lookups from their owners, together (`_route_all`: a collective)."""
        asks = []
        for w in waiting:
            plan = ExchangePlan.of(w.ids, self.workers)
            asks.append(
                _Ask(
                    w.table,
                    w.ids[plan.order],
                    plan,
                    functools.partial(_answer, self.shards[w.table]),
                    out_of_range(w.ids, self.modules[w.table].num_embeddings),
                )
            )
        return self._route_all(asks)

    def route(
        self,
        name: str,
        sent: torch.Tensor,
        plan: ExchangePlan,
        answer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, _Route]:
        """A lookup of table `name` at once (a collective; the waiting lookups are fetched first): `sent` (a row
        per unique id, grouped by owner as `plan` says) goes to the owners, each owner's `answer(what it was
        sent)` -> (the rows' keys there, their values) comes back; returns the values in the order of `plan`'s
        ids and the `_Route` the gradients take back to those keys."""
        self.flush()
        return self._route_all([_Ask(name, sent, plan, answer)])[0]

    def _route_all(self, asks: list[_Ask]) -> list[tuple[torch.Tensor, _Route]]:
        """A batch of lookups (`_Ask`s, at most `BATCH`) in one tagged exchange of every lookup's ids, one
        exchange of the rest of any block that did not fit, and one of every lookup's rows (as bytes: tables
        may differ in dim and dtype); per lookup, its values in the order of its plan's ids and its `_Route`.
        Refuses, on every worker, a batch in which any worker's lookup holds an id outside its table."""
        widths = [math.prod(a.sent.shape[1:]) for a in asks]  # int64 elements per id (a dynamic table's: 2)
        blocks = [a.sent.reshape(-1).split([c * n for c in a.plan.counts]) for a, n in zip(asks, widths)]
        to = [torch.cat([b[w] for b in blocks]) for w in range(self.workers)]  # every lookup's ids for worker w
        bad = next(((i, a.bad) for i, a in enumerate(asks) if a.bad is not None), None)
        capacity, names = self.capacity, "+".join(a.name for a in asks)
        counts, flags, heads = self._meta(
            [self._index[a.name] for a in asks],
            [[b[w].numel() for b in blocks] for w in range(self.workers)],
            (1, bad[1], bad[0]) if bad else (0, 0, 0),
            f"{names} ids",
            tuple(to),
        )
        if (culprits := flags[:, 0].nonzero().view(-1)).numel():
            w = int(culprits[0])
            table = asks[int(flags[w, 2])].name
            raise bad_id_error(table, self.modules[table].num_embeddings, int(flags[w, 1]), w)
        elements = counts[:, : len(asks)].sum(1).tolist()
        parts = [heads[w, : min(n, capacity)] for w, n in enumerate(elements)]
        if int(flags[:, 3].max()) > capacity:  # some worker's block did not fit: the rest of every block
            rest = [max(0, n - capacity) for n in elements]
            more = self._all_to_all(
                f"{names} more ids",
                torch.cat([b[capacity:] for b in to]),
                [max(0, b.numel() - capacity) for b in to],
                rest,
            )
            parts = [torch.cat(pair) for pair in zip(parts, more.split(rest))]
        asked = [part.split(counts[w, : len(asks)].tolist()) for w, part in enumerate(parts)]  # by worker, lookup
        answers = []
        for i, (a, n) in enumerate(zip(asks, widths)):
            keys, rows = a.answer(torch.cat([asked[w][i] for w in range(self.workers)]).view(-1, *a.sent.shape[1:]))
            answers.append(([int(counts[w, i]) // n for w in range(self.workers)], keys, rows))
        got = self._rows_exchange(
            f"{names} rows",
            [rows for _, _, rows in answers],
            [asked_counts for asked_counts, _, _ in answers],
            [a.plan.counts for a in asks],
        )
        out = []
        for a, (asked_counts, keys, rows), mine in zip(asks, answers, got):
            values = rows.new_empty((a.plan.order.numel(), *rows.shape[1:]))
            values[a.plan.order] = mine
            out.append((values, _Route(a.plan, asked_counts, keys)))
        return out

    def _read(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the unique global `ids`, asked of each owner alone over torch RPC once it has applied
        this worker's steps (each call bounded by the step timeout); an id outside the table refused here."""
        check_ids(name, ids, self.modules[name].num_embeddings)
        owner = owners(ids, self.workers)
        futures = {
            w: rpc.rpc_async(
                worker_name(w),
                _rows_at,
                args=(name, ids[owner == w], self.applied, self.timeout),
                timeout=2 * self.timeout,
            )
            for w in range(self.workers)
            if w != self.worker and bool((owner == w).any())
        }
        shard = self.shards[name]
        values = shard.values.new_empty((ids.numel(), shard.values.shape[1]))
        mine = owner == self.worker
        values[mine] = shard.values.index_select(0, local_index(shard.owned, ids[mine]))
        for w, fut in futures.items():
            values[owner == w] = fut.wait()
        return values

    def exchange_grads(
        self, context_id: int, grads: dict[torch.Tensor, torch.Tensor], scale: float
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, int]]:
        """Send the owners the gradients of this context's lookups (`grads`, dist_autograd's) times `scale`,
        back the routes their ids took (`_Route`): one exchange of flags for the step, then the gradients of
        each lookup. Returns this owner's rows of each table, (local indices, gradient summed over the workers
        and divided by W), and where some worker's own row gradients held a NaN/Inf, {the table looked up
        first among those: the first such worker}. Every worker must call it; forgets the context's lookups."""
        self.flush()  # lookups whose results were never used (none of the forward's: its end fetched them)
        lookups = self._lookups.pop(context_id, [])
        self._lookups.clear()  # lookups of contexts that were never stepped
        sending = []
        for lk in lookups:
            g = grads.get(lk.leaf)
            g = lk.leaf.new_zeros(lk.leaf.shape) if g is None else g * scale if scale != 1.0 else g
            sending.append(g[lk.pulled.plan.order])
        bad = next((i for i, g in enumerate(sending) if first_nonfinite([g]) is not None), None)
        made, flags, _ = self._meta(
            [_STEP], [[len(lookups)]] * self.workers, (bad is not None, 0, bad or 0), "grad flags"
        )
        if (other := (made[:, 0] != len(lookups)).nonzero().view(-1)).numel():
            w = int(other[0])
            raise RuntimeError(
                f"worker {w} looked up {int(made[w, 0])} sharded tables in this step and worker "
                f"{self.worker} {len(lookups)}: every worker must look up every sharded table in "
                "every forward (nothing was applied)"
            )
        nonfinite = {}
        if (flagged := flags[:, 0].nonzero().view(-1)).numel():
            first = int(flags[flagged, 2].min())
            nonfinite[lookups[first].table] = int(flagged[flags[flagged, 2] == first][0])
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by table: (local rows, their gradients)
        home = self._rows_exchange(
            "row grads", sending, [lk.pulled.plan.counts for lk in lookups], [lk.pulled.asked_counts for lk in lookups]
        )  # each in `_Route.asked`'s order
        for lk, got in zip(lookups, home):
            parts.setdefault(lk.table, []).append((lk.pulled.asked, got))
        return {name: merge_rows(got, 1.0 / self.workers) for name, got in parts.items() if got}, nonfinite

    def _rows_exchange(
        self, lane: str, sending: list[torch.Tensor], send_counts: list[list[int]], recv_counts: list[list[int]]
    ) -> list[torch.Tensor]:
        """One all-to-all of several lookups' rows, as bytes (tables may differ in dim and dtype), lane `lane`:
        `send_counts[i][w]` rows of `sending[i]` (grouped by worker) go to worker w, `recv_counts[i][w]` come
        from it. Returns, per lookup, the rows received, in worker order, of `sending[i]`'s dtype and row shape."""
        if not sending:
            return []
        row_bytes = [t.element_size() * math.prod(t.shape[1:]) for t in sending]
        blocks = [
            t.reshape(-1).view(torch.uint8).split([c * n for c in counts])
            for t, counts, n in zip(sending, send_counts, row_bytes)
        ]
        back = [[c * n for c in counts] for counts, n in zip(recv_counts, row_bytes)]
        got = self._all_to_all(
            lane,
            torch.cat([b[w] for w in range(self.workers) for b in blocks]),
            [sum(b[w].numel() for b in blocks) for w in range(self.workers)],
            [sum(b[w] for b in back) for w in range(self.workers)],
        )
        chunks = got.split([b[w] for w in range(self.workers) for b in back])  # by worker, then lookup
        out = []
        for i, t in enumerate(sending):
            rows = torch.cat([chunks[w * len(sending) + i] for w in range(self.workers)])
            out.append(rows.view(t.dtype).view(-1, *t.shape[1:]))
        return out

    def apply(
        self,
        received: dict[str, tuple[torch.Tensor, torch.Tensor]],
        coefficient: float,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """One row optimizer step of each table on this owner's rows of `exchange_grads` times `coefficient`
        (the learning rate of a table's exact row form follows its group's schedule); `received` {}: a
        skipped step, which counts all the same."""
        with self._stepped:
            for name, (local, grads) in received.items():
                shard = self.shards[name]
                if shard.group is not None and optimizer.param_groups[shard.group]["lr"] != shard.optimizer.lr:
                    shard.optimizer = dataclasses.replace(
                        shard.optimizer, lr=float(optimizer.param_groups[shard.group]["lr"])
                    )
                if local.numel():
                    shard.optimizer.step(
                        shard.values, shard.state, local, grads * coefficient if coefficient != 1.0 else grads
                    )
            self.applied += 1
            self._stepped.notify_all()

    def partial_norms(self, received: dict[str, tuple[torch.Tensor, torch.Tensor]], clipping) -> list[float]:
        """Every worker's partial norm of its rows' averaged gradients (`Clipping.partial`), in worker order: the
        tables' part of the step's total norm. Every worker must call it."""
        mine = torch.tensor([clipping.partial([g for _, g in received.values()])], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(self.workers)]
        dist.all_gather(every, mine)
        return [float(p) for p in every]

    def checkpoint(self) -> dict[str, dict]:
        """Copies of this worker's rows of each table (ids, values) and of their row optimizer state."""
        return {
            name: {"ids": shard.owned.clone(), "values": shard.values.clone(), "state": saved_state(shard.state)}
            for name, shard in self.shards.items()
        }

    def restore(self, saved: Iterable[dict[str, dict]], where: str) -> None:
        """Take this worker's rows of each table, with their row optimizer state, from the `checkpoint()`s of
        the workers of a checkpoint (`saved`, this worker's own first: with as many workers as wrote it, its
        own file holds them all, and no other is read), written by any number of workers.

        Raises:
            ValueError: `saved` lacks some of this worker's rows, naming the table.
        """
        taken = dict.fromkeys(self.shards, 0)
        for tables in saved:
            for name, rows in tables.items():
                if (shard := self.shards.get(name)) is None:
                    continue
                mine = (owners(rows["ids"], self.workers) == self.worker).nonzero().view(-1)
                local = local_index(shard.owned, rows["ids"][mine])
                shard.values[local] = rows["values"][mine]
                take_saved_state(shard.state, local, rows["state"], mine)
                taken[name] += mine.numel()
            if all(taken[name] == shard.owned.numel() for name, shard in self.shards.items()):
                return
        name = next(n for n, shard in self.shards.items() if taken[n] != shard.owned.numel())
        raise ValueError(
            f"{where} holds {taken[name]} of the {self.shards[name].owned.numel()} rows of table "
            f"{name!r} that worker {self.worker} owns: it was written by another model, or with its "
            "tables split another way (Trainer(tables=...)); resume with the model and settings that "
            "wrote it, or start without --resume"
        )

    def commit_load(self) -> None:
        """After a module's `load_state_dict` succeeded: this worker's rows of each table it loaded (every worker
        loads the same state; the row optimizer's state stays, as torch's optimizer's does)."""
        with self._stepped:  # not while another worker reads them (`rows_of`)
            for name, weight in self.loaded.items():
                shard = self.shards[name]
                shard.values.copy_(weight[shard.owned])
        self.discard_load()

    def rows_of(
        self, table: str, step: int, timeout: float, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's rows of `table` (ids, a copy of the values; with `ids`, those of its rows) once it has
        applied `step` steps."""
        with self._stepped:
            if not self._stepped.wait_for(lambda: self.applied >= step, timeout):
                raise TimeoutError(
                    f"worker {self.worker} was asked for its rows of table {table!r} after step "
                    f"{step} and had applied {self.applied} steps after {timeout:.0f} s"
                )
            shard = self.shards[table]
            if ids is None:
                return shard.owned, shard.values.clone()
            return ids, shard.values.index_select(0, local_index(shard.owned, ids))

    def whole(self, table: str) -> torch.Tensor:
        """The whole table `table`, each owner's rows as it holds them after this worker's last step (torch
        RPC to every other worker, each bounded by the step timeout)."""
        spec = next(s for s in self.specs if s.name == table)
        check_gatherable(table, spec.shape, spec.dtype)
        futures = {
            w: rpc.rpc_async(
                worker_name(w), _rows_of, args=(table, self.applied, self.timeout), timeout=2 * self.timeout
            )
            for w in range(self.workers)
            if w != self.worker
        }
        out = torch.empty(spec.shape, dtype=spec.dtype)
        shard = self.shards[table]
        out[shard.owned] = shard.values
        for fut in futures.values():
            ids, values = fut.wait()
            out[ids] = values
        return out

    def gathered_tables(self) -> dict[str, torch.Tensor]:
        """Every whole table, gathered from its owners (`whole`)."""
        return {spec.name: self.whole(spec.name) for spec in self.specs}
