"""Worker side of embedding tables split across the workers by row (the sharded strategy), over all-to-all.

Every worker owns the rows `tables.row_partition` gives it and stores only those, with their row optimizer
state. A lookup (`ServedTables._lookup`, whose forward this reuses) sends its batch's unique ids to their
owners and gets their rows back: two `all_to_all_single` exchanges among the workers (how many ids each sends
each, with a flag for an id out of the table, and the first ids of each block; the rows), after which the
lookup runs on the rows as a leaf. The first is tagged and of one size for every worker: each block carries
up to `capacity` ids, zero-padded, which every worker grows alike to the largest block any worker has sent
(at most `ID_CAPACITY`); when some worker's block did not fit, one more exchange carries the rest of every
block (a job's first lookups, a batch larger than any before). The lookup keeps the route its ids took
(`_Route`: the plan, and on the owner the local rows each worker asked for), so at the step each worker sends
its rows' gradients back along it, with no ids and no counts: one exchange of flags for the whole step (a
NaN/Inf in some worker's row gradients, how many lookups it made), then one of the gradients of every lookup
(as bytes: tables may differ in dim and dtype); an owner sums what every worker sent, divides by W (DDP's
mean) and applies the row optimizer. Every exchange is a collective: every worker makes it, for every table,
in model order, with or without ids (an empty batch sends and receives only the tagged exchange). So every worker
knows of an out-of-range id or a NaN/Inf row gradient on any worker and refuses together, before anything
is looked up or applied. The tagged exchanges (a table's lookup, the end of a forward, which every forward
with gradients ends with, the step's flags) carry the exchange each worker is at: a worker whose forward
skipped a table, or looked up another, makes every worker raise at once, naming the table, where it would
otherwise pair unrelated exchanges (they are of one size, so such a pair still completes). With 4 tables a
step makes 11 exchanges (2 per lookup, the forward's end, the flags, the gradients) besides DDP's allreduce.

A dynamic table's lookups (`worker.sharded_dynamic`) go along the same `route`, tagged like a table's: (id,
count) rows out, which the owner's `DynamicShard` answers; their gradients come back with the fixed tables' at
the step, keyed by id.

The whole tables (`trainer.state_dict()`, and the user's module's `state_dict()`, as under ps) are gathered
over torch RPC: each owner answers with its rows once it has applied as many steps as the asking worker,
so a worker that gathers alone (worker 0 saving the model) gets one consistent step.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from gradsync.core.errors import bad_id_error
from gradsync.core.finite import first_nonfinite
from gradsync.core.job_names import worker_name
from gradsync.tables.placement import check_id_dtype, check_ids, merge_rows, out_of_range
from gradsync.tables.row_optim import saved_state, take_saved_state
from gradsync.tables.row_partition import ExchangePlan, local_index, owned_rows, owners
from gradsync.worker.served_tables import ServedTables

_STEP, _FORWARD_END = -1, -2
"""The tags of the step's exchange of flags and of a forward's end (`ShardedTables._meta`); a lookup's is its
table's index."""

_HEADER = 5
"""The int64s ahead of the ids in a tagged exchange's block for each worker (`ShardedTables._meta`): the tag,
three of the exchange's own, the sender's largest block of ids for any worker."""

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
    state: object
    optimizer: object
    group: int | None  # the optimizer group whose learning rate the rows follow (an exact row form), or None


@dataclasses.dataclass(frozen=True)
class _Route:
    """Where a lookup's unique ids went, which its gradients take back at the step: this worker's `plan`,
    how many ids each worker asked this one for (`asked_counts`) and their rows' keys here (`asked`: local rows
    of a fixed table, ids of a dynamic one)."""

    plan: ExchangePlan
    asked_counts: list[int]
    asked: torch.Tensor


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """All-to-all of variable-size blocks of rows: `send_counts[w]` rows of `send` to worker w, `recv_counts[w]`
    rows from it, in worker order. Every worker must call it."""
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts)
    return out


def _rows_of(table: str, step: int, timeout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RPC handler: this worker's rows of `table` (ids, values) once it has applied `step` steps."""
    return _HELD.rows_of(table, step, timeout)


def _rows_at(table: str, ids: torch.Tensor, step: int, timeout: float) -> torch.Tensor:
    """RPC handler: this worker's rows `ids` of `table` once it has applied `step` steps."""
    return _HELD.rows_of(table, step, timeout, ids)[1]


class ShardedTables(ServedTables):
    """The model's row-wise tables (`served_tables.choose_tables`), split by row across the workers."""

    def __init__(self, tables: dict[str, nn.Module], rows: dict[str, tuple], worker: int, workers: int,
                 timeout: float, dynamic: Iterable[str] = ()):
        """`dynamic`: the names of the model's dynamic tables, whose lookups go along `route` too
        (`worker.sharded_dynamic`)."""
        super().__init__(tables, workers, None)
        self.worker, self.workers, self.timeout = worker, workers, timeout
        self.rows = rows
        self.looked_up = [spec.name for spec in self.specs] + list(dynamic)  # by exchange tag
        self._index = {name: i for i, name in enumerate(self.looked_up)}
        self.shards: dict[str, _Shard] = {}
        self.applied = 0  # steps applied to this worker's rows (skipped ones included)
        self.capacity = 0  # id elements per worker in every tagged exchange (`_meta`): the same on every worker
        self._stepped = threading.Condition()

    def take_rows(self, weights: dict[str, torch.Tensor]) -> None:
        """Keep this worker's rows of each table of worker 0's `weights` (by table; a collective), with a fresh
        row optimizer state; this worker then answers the others' gathers."""
        global _HELD
        for spec in self.specs:
            owned = owned_rows(spec.shape[0], self.worker, self.workers)
            optimizer, group = self.rows[spec.name]
            values = self._scatter(spec, weights[spec.name], self.modules[spec.name].padding_idx, owned)
            self.shards[spec.name] = _Shard(owned, values, optimizer.new_state(owned.numel(), spec.shape[1],
                                                                                spec.dtype), optimizer, group)
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

    def _all_to_all(self, what: str, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
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

    def _meta(self, at: int, rows: list[list[int]], lane: str, blocks: tuple[torch.Tensor, ...] = ()
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send worker w the three ints `rows[w]` and the first `capacity` elements of `blocks[w]` (a lookup's
        ids for it; none for the other exchanges), tagged with the exchange each worker is at (`at`: a table's
        index for its lookup, `_STEP`, `_FORWARD_END`), as lane `lane`; every worker must call it, and all at
        the same exchange. Returns each worker's ints for this one with its largest block for any worker (W x 4)
        and the ids it sent this one (W x the capacity before the call, zero-padded). The capacity then grows to
        the largest block of any worker (at most `ID_CAPACITY`), the same on every worker.

        Raises:
            RuntimeError: another worker is at another exchange (a forward that skipped a table, or looked
                one up where this worker did not), naming both and the fix; that worker raises it too.
        """
        capacity = self.capacity
        meta = torch.zeros(self.workers, _HEADER + capacity, dtype=torch.int64)
        meta[:, 0] = at
        meta[:, 1:4] = torch.tensor(rows, dtype=torch.int64)
        meta[:, 4] = max((block.numel() for block in blocks), default=0)
        for w, block in enumerate(blocks):
            head = block[:capacity]
            meta[w, _HEADER:_HEADER + head.numel()] = head
        theirs = self._all_to_all(lane, meta, [1] * self.workers, [1] * self.workers)
        self.capacity = max(capacity, min(ID_CAPACITY, int(theirs[:, 4].max())))
        if (other := (theirs[:, 0] != at).nonzero().view(-1)).numel():
            w = int(other[0])
            raise RuntimeError(
                f"worker {self.worker} is at {self._tag(at)} and worker {w} at {self._tag(int(theirs[w, 0]))}: "
                "every worker must look up every sharded table in every forward, in the same order (each lookup "
                "is an exchange with every worker); call a table with an empty batch where a worker has no ids "
                "for it (nothing was looked up or applied)")
        return theirs[:, 1:_HEADER], theirs[:, _HEADER:]

    def _tag(self, at: int) -> str:
        """The exchange tagged `at`, in words."""
        return {_STEP: "trainer.step", _FORWARD_END: "the end of a forward"}.get(at) or \
            f"a lookup of table {self.looked_up[at]!r}"

    def forward_ended(self) -> None:
        """Tell every worker that this one's forward is over (a collective at the end of every forward with
        gradients): a worker whose forward skipped a table the others look up last raises here, at once,
        with them, where it would otherwise meet them only at DDP's allreduce, a mismatch gloo reports after
        the process group's timeout."""
        self._meta(_FORWARD_END, [[0, 0, 0]] * self.workers, "forward end")

    def model_sizes(self, trainable: int) -> dict[str, int]:
        return {**super().model_sizes(trainable), "sharded_tables": len(self.specs)}

    def _check(self, name: str, ids: torch.Tensor, rows: int) -> None:
        check_id_dtype(name, ids)  # the range is checked by every worker together, in `_pull`

    def _pull(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, _Route | None]:
        """The rows of the unique global `ids` from their owners, and their `_Route`; refuses (on every worker)
        a lookup in which any worker's batch holds an id outside the table. A forward without gradients
        (evaluation, which one worker may run alone, say worker 0 after training) reads them without a
        collective (`_read`) and has no route."""
        if not torch.is_grad_enabled():
            return self._read(name, ids), None
        plan = ExchangePlan.of(ids, self.workers)
        shard = self.shards[name]

        def answer(asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            local = local_index(shard.owned, asked)
            return local, shard.values.index_select(0, local)

        return self.route(name, ids[plan.order], plan, answer, out_of_range(ids, self.modules[name].num_embeddings))

    def route(self, name: str, sent: torch.Tensor, plan: ExchangePlan,
              answer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], bad: int | None = None
              ) -> tuple[torch.Tensor, _Route]:
        """A lookup of table `name` (a collective): `sent` (a row per unique id, grouped by owner as `plan`
        says) goes to the owners, each owner's `answer(what it was sent)` -> (the rows' keys there, their
        values) comes back; returns the values in the order of `plan`'s ids and the `_Route` the gradients take
        back to those keys. `bad`: an id of this worker's batch outside the table, refused on every worker."""
        width = math.prod(sent.shape[1:])  # int64 elements per id (a dynamic table's: the id and its count)
        blocks = sent.reshape(-1).split([c * width for c in plan.counts])
        capacity = self.capacity
        theirs, heads = self._meta(self._index[name], [[b.numel(), bad is not None, bad or 0] for b in blocks],
                                   f"{name} ids", blocks)
        if (culprits := theirs[:, 1].nonzero().view(-1)).numel():
            raise bad_id_error(name, self.modules[name].num_embeddings, int(theirs[culprits[0], 2]),
                               int(culprits[0]))
        elements = theirs[:, 0].tolist()
        parts = [heads[w, :min(n, capacity)] for w, n in enumerate(elements)]
        if int(theirs[:, 3].max()) > capacity:  # some worker's block did not fit: the rest of every block
            rest = [max(0, n - capacity) for n in elements]
            more = self._all_to_all(f"{name} more ids", torch.cat([b[capacity:] for b in blocks]),
                                    [max(0, b.numel() - capacity) for b in blocks], rest)
            parts = [torch.cat(pair) for pair in zip(parts, more.split(rest))]
        asked_counts = [n // width for n in elements]
        keys, rows = answer(torch.cat(parts).view(-1, *sent.shape[1:]))
        values = rows.new_empty((plan.order.numel(), *rows.shape[1:]))
        values[plan.order] = self._all_to_all(f"{name} rows", rows, asked_counts, plan.counts)
        return values, _Route(plan, asked_counts, keys)

    def _read(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the unique global `ids`, asked of each owner alone over torch RPC once it has applied
        this worker's steps (each call bounded by the step timeout); an id outside the table refused here."""
        check_ids(name, ids, self.modules[name].num_embeddings)
        owner = owners(ids, self.workers)
        futures = {w: rpc.rpc_async(worker_name(w), _rows_at, args=(name, ids[owner == w], self.applied,
                                                                     self.timeout), timeout=2 * self.timeout)
                   for w in range(self.workers) if w != self.worker and bool((owner == w).any())}
        shard = self.shards[name]
        values = shard.values.new_empty((ids.numel(), shard.values.shape[1]))
        mine = owner == self.worker
        values[mine] = shard.values.index_select(0, local_index(shard.owned, ids[mine]))
        for w, fut in futures.items():
            values[owner == w] = fut.wait()
        return values

    def exchange_grads(self, context_id: int, grads: dict[torch.Tensor, torch.Tensor], scale: float
                       ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, int]]:
        """Send the owners the gradients of this context's lookups (`grads`, dist_autograd's) times `scale`,
        back the routes their ids took (`_Route`): one exchange of flags for the step, then the gradients of
        each lookup. Returns this owner's rows of each table, (local indices, gradient summed over the workers
        and divided by W), and where some worker's own row gradients held a NaN/Inf, {the table looked up
        first among those: the first such worker}. Every worker must call it; forgets the context's lookups."""
        lookups = self._lookups.pop(context_id, [])
        self._lookups.clear()  # lookups of contexts that were never stepped
        sending = []
        for lk in lookups:
            g = grads.get(lk.leaf)
            g = lk.leaf.new_zeros(lk.leaf.shape) if g is None else g * scale if scale != 1.0 else g
            sending.append(g[lk.pulled.plan.order])
        bad = next((i for i, g in enumerate(sending) if first_nonfinite([g]) is not None), None)
        theirs, _ = self._meta(_STEP, [[len(lookups), bad is not None, bad or 0]] * self.workers, "grad flags")
        if (other := (theirs[:, 0] != len(lookups)).nonzero().view(-1)).numel():
            w = int(other[0])
            raise RuntimeError(f"worker {w} looked up {int(theirs[w, 0])} sharded tables in this step and worker "
                               f"{self.worker} {len(lookups)}: every worker must look up every sharded table in "
                               "every forward (nothing was applied)")
        nonfinite = {}
        if (flagged := theirs[:, 1].nonzero().view(-1)).numel():
            first = int(theirs[flagged, 2].min())
            nonfinite[lookups[first].table] = int(flagged[theirs[flagged, 2] == first][0])
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by table: (local rows, their gradients)
        for lk, got in zip(lookups, self._grads_home(lookups, sending)):
            parts.setdefault(lk.table, []).append((lk.pulled.asked, got))
        return {name: merge_rows(got, 1.0 / self.workers) for name, got in parts.items() if got}, nonfinite

    def _grads_home(self, lookups: list, sending: list[torch.Tensor]) -> list[torch.Tensor]:
        """One all-to-all of every lookup's row gradients (`sending`, grouped by owner as its plan says), as
        bytes: worker w gets each lookup's block for it, in lookup order. Returns, per lookup, the rows every
        worker sent this owner for it, in worker order (`_Route.asked`'s order)."""
        if not lookups:
            return []
        row_bytes = [g.element_size() * math.prod(g.shape[1:]) for g in sending]
        blocks = [g.reshape(-1).view(torch.uint8).split([c * n for c in lk.pulled.plan.counts])
                  for lk, g, n in zip(lookups, sending, row_bytes)]
        send = torch.cat([b[w] for w in range(self.workers) for b in blocks])
        asked = [[c * n for c in lk.pulled.asked_counts] for lk, n in zip(lookups, row_bytes)]
        got = self._all_to_all("row grads", send, [sum(b[w].numel() for b in blocks) for w in range(self.workers)],
                               [sum(a[w] for a in asked) for w in range(self.workers)])
        chunks = got.split([a[w] for w in range(self.workers) for a in asked])  # by worker, then lookup
        out = []
        for i, g in enumerate(sending):
            rows = torch.cat([chunks[w * len(lookups) + i] for w in range(self.workers)])
            out.append(rows.view(g.dtype).view(-1, *g.shape[1:]))
        return out

    def apply(self, received: dict[str, tuple[torch.Tensor, torch.Tensor]], coefficient: float,
              optimizer: torch.optim.Optimizer) -> None:
        """One row optimizer step of each table on this owner's rows of `exchange_grads` times `coefficient`
        (the learning rate of a table's exact row form follows its group's schedule); `received` {}: a
        skipped step, which counts all the same."""
        with self._stepped:
            for name, (local, grads) in received.items():
                shard = self.shards[name]
                if shard.group is not None and optimizer.param_groups[shard.group]["lr"] != shard.optimizer.lr:
                    shard.optimizer = dataclasses.replace(shard.optimizer,
                                                          lr=float(optimizer.param_groups[shard.group]["lr"]))
                if local.numel():
                    shard.optimizer.step(shard.values, shard.state, local, grads * coefficient
                                         if coefficient != 1.0 else grads)
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
        return {name: {"ids": shard.owned.clone(), "values": shard.values.clone(), "state": saved_state(shard.state)}
                for name, shard in self.shards.items()}

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
        raise ValueError(f"{where} holds {taken[name]} of the {self.shards[name].owned.numel()} rows of table "
                         f"{name!r} that worker {self.worker} owns: it was written by another model, or with its "
                         "tables split another way (Trainer(tables=...)); resume with the model and settings that "
                         "wrote it, or start without --resume")

    def rows_of(self, table: str, step: int, timeout: float, ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's rows of `table` (ids, a copy of the values; with `ids`, those of its rows) once it has
        applied `step` steps."""
        with self._stepped:
            if not self._stepped.wait_for(lambda: self.applied >= step, timeout):
                raise TimeoutError(f"worker {self.worker} was asked for its rows of table {table!r} after step "
                                   f"{step} and had applied {self.applied} steps after {timeout:.0f} s")
            shard = self.shards[table]
            if ids is None:
                return shard.owned, shard.values.clone()
            return ids, shard.values.index_select(0, local_index(shard.owned, ids))

    def _gathered(self, spec, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        if self.serving:
            state_dict[prefix + "weight"] = self.whole(spec.name)

    def whole(self, table: str) -> torch.Tensor:
        """The whole table `table`, each owner's rows as it holds them after this worker's last step (torch
        RPC to every other worker, each bounded by the step timeout)."""
        spec = next(s for s in self.specs if s.name == table)
        futures = {w: rpc.rpc_async(worker_name(w), _rows_of, args=(table, self.applied, self.timeout),
                                    timeout=2 * self.timeout)
                   for w in range(self.workers) if w != self.worker}
        out = torch.empty(spec.shape, dtype=spec.dtype)
        shard = self.shards[table]
        out[shard.owned] = shard.values
        for fut in futures.values():
            ids, values = fut.wait()
            out[ids] = values
        return out

    def full(self, named_by_server=None) -> dict[str, torch.Tensor]:
        return {spec.name: self.whole(spec.name) for spec in self.specs}
