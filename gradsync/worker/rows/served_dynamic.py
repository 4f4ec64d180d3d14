"""Worker side of dynamic embedding tables (`gradsync.DynamicEmbedding`) under ps and hybrid: the rows live on
the servers, an id on server `tables.id_hash.server_of(id, S)`, each server a `DynamicTable` of its ids
(`ps.dynamic_shard`). Under sharded the workers are its servers (`worker.rows.sharded_dynamic`).

`ServedDynamic` replaces each such module's forward: a forward that records (training mode, gradients on,
inside a dist_autograd context) returns a `PendingRows` at once, and the first use of any waiting lookup (or
the user's forward's end) sends each server, in one call, its ids of every waiting lookup, distinct, with their
counts, for step `step` (rows as at the step's start; admitted ids created there with `init`); each lookup then
runs the module's `embed` on its rows as a leaf. Any other forward only reads (zeros where not resident).
`row_grads` turns the leaves' gradients into each server's push ({table: `RowGrads`} of the admitted ids,
occurrences summed); the consistency rule averages them over the workers and the row optimizer applies them.
After the step's push, `end_step` ends the step on every server, with the bounds by `capacity` over the whole
table (`tables.global_eviction`; the push's replies bring each server's `end` answer). The evictions it decides
travel with the next step's first lookups, to every server (those holding none of the batch's ids get an
empty list of lookups), which apply them before looking up: a round trip saved a step. Any other call on the servers
sends them first (`send_evictions`: reads, state, counters, stats, checkpoints, the next push), so every
reader, and the next step's end, finds the step ended. A worker that took fewer steps (`trainer.join()`)
takes the servers' step (`resync`).

In async and ssp mode no step spans the servers: each server steps its part of the table by itself, after each
push it applies, over its share of `capacity` (`ps.dynamic_shard`), and `end_step` only counts. A job
checkpoint holds the servers' tables (`ps.shard_file`, `ps.reshard`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from gradsync.core.torch_internals import current_context_id
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.ps.messages import (
    DynamicSetup,
    EndStep,
    Evict,
    FirstToGo,
    LoadTables,
    Lookups,
    ReadRows,
    RowGrads,
    TableCall,
    TablesCounts,
    TablesState,
    TablesStep,
)
from gradsync.tables import global_eviction
from gradsync.tables.dynamic_checkpoint import rehomed
from gradsync.tables.dynamic_embedding import DynamicEmbedding
from gradsync.tables.id_hash import server_of
from gradsync.tables.placement import merge_rows
from gradsync.tables.row_init import checked_init
from gradsync.tables.row_optim import ROW_OPTIMIZERS
from gradsync.worker.module.plain_module import Attachments, check_gatherable
from gradsync.worker.rows.choice import find_dynamic
from gradsync.worker.rows.pending_rows import WaitingLookups, resolved

_COUNTERS = ("admitted", "filtered", "evicted")


@dataclasses.dataclass(frozen=True)
class _Waiting:
    """A recording lookup whose rows are not fetched yet: its table and module, the distinct ids with their
    counts, each input's place among them, the bag's offsets and per-sample weights, and the dist_autograd
    context it was made in."""

    table: str
    module: DynamicEmbedding
    ids: torch.Tensor
    counts: torch.Tensor
    inverse: torch.Tensor
    bag: tuple
    context: int


class _Lookup:
    """One recording lookup: the distinct ids, which were admitted, their rows (a leaf), each server's version
    and the positions of its ids."""

    def __init__(
        self,
        table: str,
        ids: torch.Tensor,
        admitted: torch.Tensor,
        leaf: torch.Tensor,
        versions: dict[int, int],
        where: dict[int, torch.Tensor],
    ):
        self.table, self.ids, self.admitted, self.leaf, self.versions = table, ids, admitted, leaf, versions
        self.where = where


class TableCalls(Protocol):
    """What answers the calls on the dynamic tables: the job's transport (their rows on the servers), or under
    sharded the workers' parts (`sharded_dynamic.WorkerParts`)."""

    def table_calls(self, calls: Mapping[int, TableCall]) -> dict[int, Any]:
        """Each call's answer, by the server (or worker) it went to."""
        ...


class ServedDynamic:
    """The model's dynamic tables, their rows on `num_servers` servers reached through `transport`."""

    def __init__(
        self,
        module: nn.Module,
        num_servers: int,
        table_optimizer,
        mode: str,
        transport: TableCalls | None,
        metrics: StepMetrics | None,
        worker: int | None = None,
    ):
        """`transport`: what answers the calls on the tables (None: the subclass's own, `ShardedDynamic`);
        `metrics`: the strategy's, where lookups count as pull; `worker`: this worker, which its lookups name."""
        self.modules = find_dynamic(module)
        self.num_servers = num_servers
        self.optimizer = table_optimizer
        self.transport = transport
        self.metrics = metrics
        self.worker = worker
        self.serving = False  # once the servers answer (`RowLayout.begin_serving`): the module's state_dict gathers
        self.step = 0  # the step the next recording lookup belongs to (sync)
        self.loaded: set[str] = set()  # the tables a module's load_state_dict loaded, not sent yet
        self.loads = 0  # the module loads sent (`commit_load`)
        self.mode = mode
        self._lookups: dict[int, list[_Lookup]] = {}
        self._evictions: dict[int, Evict] = {}  # the last step's evictions by server, not sent yet (`evict`)
        self._waiting = WaitingLookups(self._results)  # recording lookups whose rows are not fetched yet (`flush`)
        if not self.modules:
            return
        name = next(iter(self.modules))
        small = [n for n, m in self.modules.items() if m.table.capacity < num_servers]
        if mode != "sync" and small:
            raise ValueError(
                f"{small[0]!r} is a gradsync.DynamicEmbedding of capacity={self.modules[small[0]].table.capacity}, "
                f"which --mode {mode} splits among the {num_servers} servers (each bounds its own ids): pass "
                f"capacity >= {num_servers}, fewer servers, or --mode sync"
            )
        if not isinstance(table_optimizer, ROW_OPTIMIZERS):
            raise ValueError(
                f"{name!r} is a gradsync.DynamicEmbedding, whose rows a row optimizer trains: pass "
                f"Trainer(..., table_optimizer=gradsync.RowSGD(lr=...) or gradsync.RowAdagrad(lr=...)), got "
                f"{table_optimizer!r}"
            )

    def setups(self, sent: bool = True) -> dict[str, DynamicSetup]:
        """What registration sends every server of each table (worker 0; not `sent`: what a worker that holds
        its part itself builds it from), its `init` checked here first."""
        out = {}
        for name, module in self.modules.items():
            t = module.table
            checked_init(t.init, torch.tensor([0, -1]), t.dim, t.dtype, t.name)
            if sent:
                try:
                    pickle.dumps(t.init)
                except Exception as e:  # noqa: BLE001 -- any pickling failure: the same advice
                    raise ValueError(
                        f"{t.name} ({name!r}): its init {t.init!r} cannot be sent to the servers "
                        f"({e}): pass a module-level function or a dataclass instance"
                    ) from e
            settings = dict(
                dim=t.dim,
                capacity=t.capacity,
                init=t.init,
                admit_after=t.admit_after,
                admit_probability=t.admit_probability,
                evict=t.evict,
                ttl_steps=t.ttl_steps,
                dtype=t.dtype,
                seed=t.seed,
                name=f"{t.name} ({name!r})",
            )
            out[name] = DynamicSetup(settings, self.optimizer)
        return out

    def take_over(self, attached: Attachments) -> None:
        """Route each table's forward through the servers, every change made through `attached`: its
        `resident_rows`, `counters` and `state_dict()` then read the servers' (once `serving`), a
        `load_state_dict` goes to them (`commit_load`), and a copy of the module holds every row (`_plain`)."""
        for name, module in self.modules.items():
            attached.set(module, "forward", functools.partial(self._forward, name, module))
            attached.set(module, "served", functools.partial(self.counters, name))
            attached.hook(module, module.register_state_dict_post_hook(functools.partial(self._gathered, name)))
            attached.hook(module, module.register_load_state_dict_post_hook(functools.partial(self._loading, name)))
            attached.plain(module, functools.partial(self._plain, name))

    def _plain(self, name: str, module: DynamicEmbedding) -> dict:
        """A dynamic table's module as an ordinary one: a local table holding every row the servers hold, as a
        `DynamicEmbedding` outside a job has."""
        check_gatherable(name, (module.table.capacity, module.table.dim), module.table.dtype)
        table = copy.deepcopy(module.table)
        prefix = f"{name}."
        table.load({k[len(prefix) :]: v for k, v in self.state().items() if k.startswith(prefix)})
        return {"table": table, "served": None}

    def _loading(self, name: str, module: DynamicEmbedding, incompatible) -> None:
        """Load-state-dict post-hook of a dynamic table's module, which loaded the state into its own (unused)
        table, checking it: `commit_load` sends it to the servers once the whole load succeeded."""
        if self.serving:
            self.loaded.add(name)

    def commit_load(self) -> None:
        """After a module's `load_state_dict` succeeded: the dynamic tables it loaded go to their servers (each
        keeps its ids; the load numbered, so the servers take it once however many workers send it), and the
        next lookups go at the step the loaded state names; the modules' own tables are emptied again."""
        if self.loaded:
            self.loads += 1
            states = {name: self.modules[name].table.state() for name in self.loaded}
            self.discard_load()
            self._load(self.loads, states)

    def _load(self, number: int, states: dict[str, dict]) -> None:
        self._call({s: LoadTables(number, states) for s in range(self.num_servers)})
        self.resync()

    def discard_load(self) -> None:
        """Forget what a module's load took (it raised, was sent, or another begins): its own (unused) tables
        emptied again."""
        for name in self.loaded:
            self.modules[name].table.reset()
        self.loaded.clear()

    def _forward(
        self, name: str, module: DynamicEmbedding, ids: torch.Tensor, offsets=None, per_sample_weights=None
    ) -> torch.Tensor:
        ids = module.checked_ids(ids, offsets, per_sample_weights)
        unique, index, counts = torch.unique(ids.reshape(-1), return_inverse=True, return_counts=True)
        context = current_context_id()
        if module.training and torch.is_grad_enabled() and context is not None:
            return self._recording(
                _Waiting(
                    name,
                    module,
                    unique,
                    counts,
                    index.reshape(ids.shape),
                    resolved((offsets, per_sample_weights)),
                    context,
                )
            )
        return module.embed(index.reshape(ids.shape), self._read(name, unique), offsets, per_sample_weights)

    def _recording(self, lookup: _Waiting) -> torch.Tensor:
        """A recording lookup's result: pending until one of the forward's lookups is used (`flush`)."""
        return self._waiting.add(
            lookup, lookup.module.output_shape(lookup.inverse, lookup.bag[0]), lookup.module.table.dtype
        )

    def flush(self) -> None:
        """Look up every waiting lookup's ids and make each one's result real (`_results`)."""
        self._waiting.flush()

    def _results(self, waiting: list[_Waiting]) -> list[torch.Tensor]:
        """The waiting lookups' results, looked up together (`_record_all`: one call per server), each lookup's
        rows a leaf kept for the step's push."""
        return [w.module.embed(w.inverse, rows, *w.bag) for w, rows in zip(waiting, self._record_all(waiting))]

    def forward_ended(self, module: nn.Module, inputs, output):
        """Forward hook of the user's module: the lookups still waiting are fetched, and their results in its
        output made real."""
        self.flush()
        return resolved(output)

    def _where(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """The positions in `ids` of each server's ids, for the servers that hold any."""
        owner = server_of(ids, self.num_servers)
        where = {s: (owner == s).nonzero().view(-1) for s in range(self.num_servers)}
        return {s: at for s, at in where.items() if at.numel()}

    def _zeros(self, name: str, count: int) -> torch.Tensor:
        table = self.modules[name].table
        return torch.zeros(count, table.dim, dtype=table.dtype)

    def _record_all(self, waiting: list[_Waiting]) -> list[torch.Tensor]:
        """The step's lookups of the waiting lookups' distinct ids (each `counts` times), one call per server
        for them all (the last step's evictions with it): each lookup's rows as a leaf that requires grad
        (zeros where not admitted), kept for the step's push."""
        start = time.perf_counter()
        wheres = [self._where(w.ids) for w in waiting]
        asked: dict[int, list] = {s: [] for s in self._evictions}
        for w, where in zip(waiting, wheres):
            for s, at in where.items():
                asked.setdefault(s, []).append((w.table, w.ids[at], w.counts[at]))
        evictions, self._evictions = self._evictions, {}
        assert self.transport is not None  # given at construction, or the subclass's own
        answers = self.transport.table_calls(
            {s: Lookups(tuple(lookups), self.step, evictions.get(s), self.worker) for s, lookups in asked.items()}
        )
        out, taken = [], {s: 0 for s in asked}
        for w, where in zip(waiting, wheres):
            rows = self._zeros(w.table, w.ids.numel())
            admitted = torch.zeros(w.ids.numel(), dtype=torch.bool)
            for s, at in where.items():
                got, admits = answers[s][1][taken[s]]
                taken[s] += 1
                rows.index_copy_(0, at, got)
                admitted.index_copy_(0, at, admits)
            rows.requires_grad_()
            versions = {s: answers[s][0] for s in where}
            self._lookups.setdefault(w.context, []).append(_Lookup(w.table, w.ids, admitted, rows, versions, where))
            out.append(rows)
        if self.metrics is not None:
            self.metrics.rows_pulled(time.perf_counter() - start, sum(rows.nbytes for rows in out))
        return out

    def _read(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the distinct `ids` (zeros where not resident), counting nothing: any forward that does not
        record (evaluation)."""
        where = self._where(ids)
        rows = self._zeros(name, ids.numel())
        if where:
            answers = self._call({s: ReadRows(name, ids[at]) for s, at in where.items()})
            for s, at in where.items():
                rows[at] = answers[s]
        return rows

    def row_grads(self, context_id: int, grads: dict[torch.Tensor, torch.Tensor]) -> dict[int, dict[str, RowGrads]]:
        """The pushes of this context's lookups: per server, {table: `RowGrads`} of its admitted ids (global
        ids) with their gradients summed over the context's lookups; forgets the context's lookups."""
        self.flush()  # a lookup whose result was never used still counts in this step
        self.send_evictions()  # before the push: the step's end on a server comes after the last one's evictions
        lookups = self._lookups.pop(context_id, [])
        self._lookups.clear()  # lookups of contexts that were never stepped
        out: dict[int, dict[str, RowGrads]] = {s: {} for s in range(self.num_servers)}
        for name in dict.fromkeys(lk.table for lk in lookups):
            mine = [lk for lk in lookups if lk.table == name and lk.leaf in grads]
            if len(mine) == 1:  # its ids distinct already, each server's where the lookup found them
                lk = mine[0]
                for s, at in lk.where.items():
                    at = at[lk.admitted[at]]
                    if at.numel():
                        out[s][name] = RowGrads(lk.versions[s], lk.ids[at], grads[lk.leaf][at])
                continue
            mine = [lk for lk in mine if lk.admitted.any()]
            if not mine:
                continue
            ids, summed = merge_rows([(lk.ids[lk.admitted], grads[lk.leaf][lk.admitted]) for lk in mine], 1.0)
            for s, at in self._where(ids).items():
                version = min(lk.versions[s] for lk in mine if s in lk.versions)
                out[s][name] = RowGrads(version, ids[at], summed[at])
        return out

    def end_step(self, replies: dict | None = None) -> None:
        """After the step's update on every server: end it there (eviction; async and ssp: the servers did), then
        the next step's lookups. `replies`: each server's reply to the step's push (`Snapshot`), whose `ended`
        (this step's) saves the `end` calls."""
        if self.modules and self.mode == "sync":
            capacities = {name: m.table.capacity for name, m in self.modules.items()}
            servers = list(range(self.num_servers))
            carried = [(replies or {}).get(s) for s in servers]
            ends = [None if c is None else c.ended for c in carried]
            ended = (
                {s: e[1] for s, e in zip(servers, ends) if e is not None}
                if all(e is not None and e[0] == self.step for e in ends)
                else None
            )
            global_eviction.end_step(self.step, capacities, servers, self, ended)
        self.step += 1

    def end(self, step: int) -> dict[int, dict]:
        """Every server's end of step `step` (`global_eviction.Holders`)."""
        return self._call({s: EndStep(step) for s in range(self.num_servers)})

    def first_to_go(self, step: int, counts: dict[int, dict[str, tuple[int, int]]]) -> dict[int, dict]:
        return self._call({s: FirstToGo(step, c) for s, c in counts.items()})

    def evict(self, step: int, plans: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """The evictions of step `step`'s end wait to go with the next step's first lookups (module docstring)."""
        self._evictions = {s: Evict(step, plan) for s, plan in plans.items()}

    def send_evictions(self) -> None:
        """Send the last step's evictions where they still wait (before any call on the servers but a lookup)."""
        if self._evictions:
            evictions, self._evictions = self._evictions, {}
            assert self.transport is not None  # given at construction, or the subclass's own
            self.transport.table_calls(evictions)

    def _call(self, calls: dict[int, TableCall]) -> dict[int, Any]:
        """Calls on the servers' dynamic tables other than a lookup, the last step's evictions sent first."""
        self.send_evictions()
        assert self.transport is not None  # given at construction, or the subclass's own
        return self.transport.table_calls(calls)

    def resync(self, newest: bool = True) -> None:
        """Take the step the servers' tables are at: after a `trainer.join()` block, in which a worker that ran
        out of data took fewer steps than the others, and after a resume; not `newest`: the step some server
        has not ended yet (a dead worker's replacement, whose step in flight a server may have ended already)."""
        if self.modules:
            steps = self._call({s: TablesStep() for s in range(self.num_servers)})
            self.step = (max if newest else min)(step for per in steps.values() for step in per.values())

    def local_keys(self) -> dict[str, torch.Tensor]:
        """The modules' own (unused) tables' state by key, which `own_state` leaves out of a state_dict."""
        return {f"{name}.{k}": v for name, m in self.modules.items() for k, v in m.table.state().items()}

    def state(self) -> dict[str, torch.Tensor]:
        """Every table's state as its module's `state_dict()` holds it, by key (`<name>.ids`, `<name>.weight`,
        ...), gathered from the servers: ids ascending, every count summed."""
        if not self.modules:
            return {}
        parts = self._call({s: TablesState() for s in range(self.num_servers)})
        out = {}
        for name in self.modules:
            for key, value in rehomed([parts[s][name] for s in sorted(parts)], 0, 1).items():
                out[f"{name}.{key}"] = value
        return out

    def counters(self, name: str) -> dict[str, int]:
        """Table `name`'s resident rows and counters, summed over the servers."""
        counts = self._call({s: TablesCounts() for s in range(self.num_servers)})
        total = {k: sum(counts[s][name][1][i] for s in counts) for i, k in enumerate(_COUNTERS)}
        return {"resident_rows": sum(counts[s][name][0] for s in counts), **total}

    def _gathered(self, name: str, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        """State-dict hook of a dynamic table's module: its state as the servers hold it (inside `own_state`:
        none of its keys, gradsync adds them itself)."""
        local = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix) :]]
        for key in local:
            del state_dict[key]
        if self.serving:
            state = self.state()
            for key in local:  # in the module's own order
                state_dict[key] = state[f"{name}.{key[len(prefix) :]}"]
