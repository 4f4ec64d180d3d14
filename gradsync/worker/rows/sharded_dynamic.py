"""Dynamic embedding tables (`gradsync.DynamicEmbedding`) under the sharded strategy: no servers; worker w owns
the ids `tables.id_hash.server_of(id, W)` gives it (the hash ps places ids on servers by) and holds them in a
`ps.dynamic_shard.DynamicShard`, the part a server would hold.

`ShardedDynamic` is `ServedDynamic` with the workers as the servers. A recording forward (training mode,
gradients on, inside a dist_autograd context) sends each owner its batch's distinct ids with their counts along
a `ShardedTables.route` (all-to-all, tagged like a fixed table's lookup, so a worker that skips a table fails on
every worker); the owner looks the ids every worker sent up at once (`DynamicShard.lookup`: admission, rows
created with `init`) and answers their rows (zeros where not admitted). The step's gradients go back along the
route with the fixed tables' (`ShardedTables.exchange_grads`: the owner sums them over the workers and divides
by W); `apply` keeps the resident ids (those admitted) and applies the row optimizer. `end_step` then ends the
step as ps does (`tables.global_eviction`: `ttl_steps` locally, the bounds by `capacity` over the whole table),
its calls answered by this worker's part and an all-gather of every worker's answer (after the step's commit,
counted in that step's metrics as exchange, with its own lane in the timeline).

Any other forward (evaluation, which one worker may run alone) reads the rows over torch RPC from each owner's
`find`, creating nothing; `trainer.state_dict()`, the module's `state_dict()`, `resident_rows` and the counters
gather the parts the same way, each owner answering once it has ended as many steps as the asking worker.

A job checkpoint holds each worker's parts in its own file, in the form a server writes them
(`DynamicShard.checkpoint`: full, or between full ones with `checkpoint_full_every` a delta, put back onto the
same worker's part of the full one at a resume); a resume takes each worker's ids from its own file alone with
as many workers as wrote it, else from every writer's, re-homed by `server_of(id, W')` (`DynamicShard.restore`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from gradsync.core.job_names import worker_name
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.metrics.traffic import object_gather_bytes
from gradsync.ps.dynamic_shard import DynamicShard, respond
from gradsync.ps.messages import EndStep, Evict, FirstToGo, LoadTables, TableCall
from gradsync.tables.dynamic_checkpoint import as_full
from gradsync.tables.id_hash import server_of
from gradsync.tables.row_partition import ExchangePlan
from gradsync.worker.rows.served_dynamic import ServedDynamic
from gradsync.worker.rows.sharded_tables import ShardedTables

_GATHERED = {EndStep: "end", FirstToGo: "smallest"}
"""The calls of a step's end that every worker makes together, answered by an all-gather: its timeline lane."""

_HELD: ShardedDynamic | None = None
"""This worker's parts, which `_answer_of` answers the other workers' reads from (torch RPC calls a function by
its module path)."""


def _answer_of(call: TableCall, step: int, timeout: float):
    """RPC handler: this worker's answer to `call` once it has ended `step` steps."""
    assert _HELD is not None  # a worker with sharded dynamic tables answers it
    return _HELD.answered_after(call, step, timeout)


class ShardedDynamic(ServedDynamic):
    """The model's dynamic tables, worker `worker` of `workers` holding its ids of each; lookups along `tables`'
    routes. Every worker must construct it, look its tables up and end every step."""

    worker: int

    def __init__(
        self,
        module: nn.Module,
        table_optimizer,
        mode: str,
        worker: int,
        workers: int,
        timeout: float,
        tables: ShardedTables,
        metrics: StepMetrics | None,
    ):
        """`tables`: the fixed tables, along whose routes the lookups go."""
        super().__init__(module, workers, table_optimizer, mode, None, metrics, worker)
        self.timeout = timeout
        self.parts = {
            name: DynamicShard(name, setup, worker, workers) for name, setup in self.setups(sent=False).items()
        }
        self.tables = tables
        self.transport = WorkerParts(self)  # `ServedDynamic`'s calls on the servers go to the workers' parts
        self._ended = threading.Condition()

    def take_over(self, attached) -> None:
        global _HELD
        super().take_over(attached)
        _HELD = self

    def _load(self, number: int, states: dict[str, dict]) -> None:
        """This worker's ids of each loaded table, from the state itself (every worker loads the same), and the
        step that state names."""
        self.respond(LoadTables(number, states))
        with self._ended:
            self.step = max(part.table.step for part in self.parts.values())
            self._ended.notify_all()

    def _recording(self, lookup) -> torch.Tensor:
        """A recording lookup, at once along `tables`' routes (which fetch the fixed tables' waiting lookups
        first)."""
        rows = self._record(lookup.context, lookup.table, lookup.ids, lookup.counts)
        return lookup.module.embed(lookup.inverse, rows, *lookup.bag)

    def _record(self, context: int, name: str, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        plan = ExchangePlan.placed(server_of(ids, self.num_servers), self.num_servers)
        sent = torch.stack([ids, counts], 1)[plan.order]
        tables = self.tables
        rows, route = tables.route(name, sent, plan, functools.partial(self._look_up, name))
        rows.requires_grad_()
        tables.record(context, name, ids, rows, route)
        return rows

    def _look_up(self, name: str, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The owner's side of a lookup: every worker's (id, count) rows `asked` (an id asked by several
        workers counts once as a sighting, their counts summed) -> (the ids, their rows)."""
        ids, inverse = torch.unique(asked[:, 0], return_inverse=True)
        counts = torch.zeros_like(ids).index_add_(0, inverse, asked[:, 1])
        rows, _ = self.parts[name].lookup(ids, counts, self.step)
        return asked[:, 0], rows[inverse]

    def admitted(
        self, received: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Of `ShardedTables.exchange_grads`' rows of the dynamic tables (ids, gradients), those of the ids
        admitted this step (resident here; the others read zeros and get no update)."""
        out = {}
        for name, (ids, grads) in received.items():
            resident = self.parts[name].table.find(ids) >= 0
            out[name] = (ids[resident], grads[resident])
        return out

    def apply(self, received: dict[str, tuple[torch.Tensor, torch.Tensor]], coefficient: float) -> None:
        """One row optimizer step on this owner's admitted rows of `admitted`, times `coefficient`."""
        for name, (ids, grads) in received.items():
            self.parts[name].apply(ids, grads * coefficient if coefficient != 1.0 else grads)

    def checkpoint(self, full: bool = True) -> dict[str, dict]:
        """This worker's part of each table, as a server writes it (`DynamicShard.checkpoint`: full, or a delta
        since the last full one)."""
        return {name: part.checkpoint(full) for name, part in self.parts.items()}

    def restore(
        self, saved: Iterable[dict[str, dict]], where: str, full: Callable[[int], dict[str, dict]] | None = None
    ) -> None:
        """Take this worker's ids of each table, with their rows, row optimizer state and admission and eviction
        state, from the `checkpoint()`s of the workers of a checkpoint (`saved`, this worker's own first: with
        as many workers as wrote it, its own part alone is read), written by any number of workers; the next
        lookups then belong to the step the checkpoint was taken after. A delta part goes onto worker k's part
        of the full checkpoint, `full(k)`.

        Raises:
            ValueError: `saved` lacks some worker's part of a table, naming the table; or holds a delta with
                no full checkpoint to put it onto.
        """
        if not self.parts:
            return
        parts: dict[str, list[dict]] = {name: [] for name in self.parts}
        for tables in saved:
            for name, part in tables.items():
                if name in parts:
                    # the writer's full part
                    onto = None if full is None else (lambda k=part["server"], n=name: full(k)[n])
                    parts[name].append(as_full(name, part, onto, where))
            if all(self.parts[n].holds_all(p) for n, p in parts.items()):
                break
        else:
            name = next(n for n, p in parts.items() if not self.parts[n].holds_all(p))
            raise ValueError(
                f"{where} holds {len(parts[name])} workers' parts of dynamic table {name!r}, not every "
                f"part worker {self.worker} takes its ids from: it was written by another model, or "
                "by a job that checkpointed no dynamic table; resume with the model that wrote it, or "
                "start without --resume"
            )
        with self._ended:
            for name, held in self.parts.items():
                held.restore(parts[name])
            self.step = max(part.table.step for part in self.parts.values())
            self._ended.notify_all()

    def end_step(self, replies: dict | None = None) -> None:
        """End the step on every worker's part (a collective): `ServedDynamic.end_step`, with the workers'
        answers gathered."""
        super().end_step(replies)
        with self._ended:
            self._ended.notify_all()

    def evict(self, step: int, plans: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """This worker's evictions of step `step`'s end, now (each worker evicts its own part)."""
        self.respond(Evict(step, plans[self.worker]))

    def respond(self, call: TableCall):
        """This worker's part's answer to `call`."""
        return respond(self.parts, call, f"worker {self.worker}")

    def answered_after(self, call: TableCall, step: int, timeout: float):
        """This worker's answer to `call` (a read, the state, the counts) once it has ended `step` steps."""
        with self._ended:
            if not self._ended.wait_for(lambda: self.step >= step, timeout):
                raise TimeoutError(
                    f"worker {self.worker} was asked for its dynamic tables after step {step} and had "
                    f"ended {self.step} steps after {timeout:.0f} s"
                )
            return self.respond(call)


class WorkerParts:
    """`ShardedDynamic`'s transport (as a parameter server's is `ServedDynamic`'s): the calls on every worker's
    part, a step's end (`EndStep`, `FirstToGo`) by an all-gather of every worker's answer (a collective), any
    other call answered by this worker's part and the others' over torch RPC (each once it has ended as many
    steps as this worker, bounded by the step timeout)."""

    def __init__(self, holder: ShardedDynamic):
        self.holder = holder

    def table_calls(self, calls: Mapping[int, TableCall]) -> dict[int, Any]:
        h = self.holder
        if type(calls.get(h.worker)) in _GATHERED:
            every = [None] * h.num_servers
            left, started = time.time(), time.perf_counter()
            dist.all_gather_object(every, h.respond(calls[h.worker]))
            if h.metrics is not None:  # after the step's commit: counted in that step
                wire = object_gather_bytes(every)
                h.metrics.gathered_after_commit(
                    _GATHERED[type(calls[h.worker])], time.perf_counter() - started, wire, wire, left
                )
            return dict(enumerate(every))
        futures = {
            w: rpc.rpc_async(worker_name(w), _answer_of, args=(call, h.step, h.timeout), timeout=2 * h.timeout)
            for w, call in calls.items()
            if w != h.worker
        }
        out = {h.worker: h.respond(calls[h.worker])} if h.worker in calls else {}
        return {**out, **{w: fut.wait() for w, fut in futures.items()}}
