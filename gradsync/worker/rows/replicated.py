"""Dynamic embedding tables under allreduce: every worker holds a full replica of each `gradsync.DynamicEmbedding`
of the model (its rows are no DDP parameters), kept identical by exchanging each step's lookups and row gradients.

A worker's forward looks its own ids up in its replica (`DynamicTable.lookup`), so it reads the rows as they are
at the start of the step, an admitted id's new row being `init(id)` on every worker alike. At `trainer.step`,
after the dense step, the workers all-gather each table's distinct looked-up ids with their occurrences and the
summed gradients of the resident rows (gloo collectives on the workers' process group, bounded by the step
timeout: the sizes, then the ids, then the gradients of each dtype, each padded to the largest worker's part).
Every replica then, in the same order and on the same tensors:
  1. counts the other workers' lookups (`DynamicTable.count_lookups`): a sighting is a step in which any worker
     looks an id up, so the replica ends the lookups as one table looking up the joint batch would (sightings,
     last steps, lookup counts, admitted rows);
  2. sums each id's gradients over the workers (in worker order: the same float sums on every replica), divides
     by the active workers as DDP averages, unscales under a GradScaler and applies the row optimizer (none when
     the dense step was skipped; a NaN/Inf in a table's row gradients raises, or with nonfinite='skip' leaves
     that table's rows as they are for the step, after the dense step, as the hybrid strategy's servers do);
  3. ends the step (`DynamicTable.end_step`: eviction).

A job checkpoint (`--checkpoint-every`) holds each table's `DynamicTable.checkpoint`: its rows with their row
optimizer state and the admission and eviction state, so a resumed job (any number of workers: every replica is
the same) makes the same decisions and updates as an uninterrupted one.

Cost: the whole table in every worker's memory; per step each worker sends its part (8 bytes per distinct id and
per occurrence count, 8 + 4 dim bytes per fp32 row gradient, padded to the largest worker's) to the W-1 others.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from gradsync.core.clipping import Clipping
from gradsync.core.errors import nonfinite_error
from gradsync.core.finite import first_nonfinite
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.tables.dynamic_checkpoint import as_full
from gradsync.tables.dynamic_embedding import STATE_KEYS, DynamicEmbedding
from gradsync.tables.row_optim import ROW_OPTIMIZERS
from gradsync.worker.module.amp import inverse_scale
from gradsync.worker.rows.layout import RowLayout


class Lookups(NamedTuple):
    """One worker's step of one table: distinct ids looked up with their occurrences, and the ids of its
    resident rows with their summed gradients."""

    ids: torch.Tensor
    occurrences: torch.Tensor
    grad_ids: torch.Tensor
    grads: torch.Tensor


class ReplicatedRows(RowLayout):
    """The model's dynamic tables, replicated on every worker. Every worker must call `apply` at every step."""

    specs = ()  # no fixed table: DDP averages those (dense, or with sparse=True gradients)

    def __init__(
        self,
        module: nn.Module | None,
        table_optimizer,
        worker: int,
        workers: int,
        nonfinite: str,
        active: Callable[[], int],
        metrics: StepMetrics,
    ):
        """The dynamic tables of `module` (None: none, the rows are held elsewhere); `active()`: how many workers
        take part in the step (fewer in a `trainer.join()` block)."""
        modules = module.named_modules() if module is not None else ()
        self.layers = {name: m for name, m in modules if isinstance(m, DynamicEmbedding)}
        if self.layers and not isinstance(table_optimizer, ROW_OPTIMIZERS):
            name = next(iter(self.layers))
            raise ValueError(
                f"{name!r} is a gradsync.DynamicEmbedding, whose rows a row optimizer trains, and "
                f"table_optimizer={table_optimizer!r}: pass gradsync.Trainer(..., table_optimizer="
                "gradsync.RowSGD(lr=...)) or gradsync.RowAdagrad(lr=...)"
            )
        for name, layer in self.layers.items():
            layer.table.name = f"{name!r} ({layer.table.name})"
            layer.table.train_with(table_optimizer)  # its state in every checkpoint, from the first
        self.optimizer, self.worker, self.workers, self.nonfinite = table_optimizer, worker, workers, nonfinite
        self.active, self.metrics = active, metrics

    @property
    def holds_dynamic(self) -> bool:
        return bool(self.layers)

    def gradients(self, context_id, grads, scaler=None) -> tuple[list[Lookups], float]:
        """This worker's part of the step, per table (`lookups`), and the scaler's inverse scale: no exchange
        yet (`apply` makes it after the dense step, in every worker's order, a joined one's too)."""
        return self.lookups(grads.get), inverse_scale(scaler)

    def partial_norms(self, step, clipping: Clipping) -> None:
        return None

    def apply(self, step: tuple[list[Lookups], float], coefficient: float | None) -> Any:
        """Exchange the step's lookups and row gradients, then steps 1 and 2 of the module docstring (the bytes
        sent counted as the step's exchange)."""
        if not self.layers:
            return None
        started = time.perf_counter()
        every, sent = exchange(step[0], self.workers)
        self.metrics.exchanged(time.perf_counter() - started, sent, sent)
        self.update(every, self.active(), step[1], coefficient is not None)
        return None

    def lookups(self, grad_of: Callable[[torch.Tensor], torch.Tensor | None]) -> list[Lookups]:
        """This worker's part of the step, per table (the gradient of a forward's rows is `grad_of(rows)`)."""
        mine = []
        for layer in self.layers.values():
            recorded = layer.take_recorded(grad_of)
            mine.append(Lookups(recorded.ids, recorded.occurrences, layer.table.ids_at(recorded.slots), recorded.grads))
        return mine

    def update(self, every: list[list[Lookups]], active: int, unscale: float, update: bool) -> None:
        """Steps 1 and 2 of the module docstring on every table, from each table's parts of every worker (in
        worker order): the mean gradient over the `active` workers times `unscale` is applied if `update` and it
        is finite (a NaN/Inf raises, naming the first worker that sent one, or with nonfinite='skip' leaves the
        table's rows as they are for this step)."""
        for (name, layer), parts in zip(self.layers.items(), every):
            table, step = layer.table, layer.table.step
            others = [p for w, p in enumerate(parts) if w != self.worker]
            if others:
                ids, inverse = torch.unique(torch.cat([p.ids for p in others]), return_inverse=True)
                occurrences = torch.zeros_like(ids).index_add_(0, inverse, torch.cat([p.occurrences for p in others]))
                table.count_lookups(ids, occurrences, step)
            grad_ids, inverse = torch.unique(torch.cat([p.grad_ids for p in parts]), return_inverse=True)
            blamed = [w for w, p in enumerate(parts) if first_nonfinite([p.grads]) is not None]
            if blamed and self.nonfinite == "raise":
                raise nonfinite_error(f"{name}.weight", blamed[0])
            if update and grad_ids.numel() and not blamed:
                grads = torch.cat([p.grads for p in parts])
                summed = grads.new_zeros((grad_ids.numel(), table.dim)).index_add_(0, inverse, grads)
                table.apply(self.optimizer, table.find(grad_ids), summed.mul_(unscale / active))

    def end_step(self, replies=None) -> None:
        """Step 3 of the module docstring on every table: its step's end (`DynamicTable.end_step`: eviction)."""
        for layer in self.layers.values():
            layer.table.end_step(layer.table.step)

    def state(self) -> dict[str, torch.Tensor]:
        """Every table's state, keyed as in the user's `model.state_dict()` (`<name>.ids`, `<name>.weight`, ...)."""
        state = {}
        for name, layer in self.layers.items():
            state.update(layer.state_dict(prefix=f"{name}." if name else ""))
        return state

    def keys(self) -> set[str]:
        """The keys of `state()`."""
        return {f"{name}.{key}" if name else key for name in self.layers for key in STATE_KEYS}

    @contextlib.contextmanager
    def own_state(self):
        """The replicas are the modules' own tables: their state is the modules' state."""
        yield

    def checkpoint(self, delta: bool) -> dict:
        """Every table's checkpoint part under "tables" (`DynamicTable.checkpoint`: rows, row optimizer state,
        admission and eviction state, step, counters; `delta`: what changed since the last full one) by the
        module's name."""
        return {"tables": {name: layer.table.checkpoint(not delta) for name, layer in self.layers.items()}}

    def restore(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None) -> None:
        """Take back `checkpoint()`'s tables from the worker file this worker restores from (the first of
        `saved`: every replica is the same), each with its row optimizer state; a delta onto the same table's
        part of that worker's file of the full checkpoint (`full()`; refused, naming `where`, without one)."""
        parts = next(iter(saved)).get("tables", {})
        onto_file = full().get("tables", {}) if full else None
        for name, part in parts.items():
            onto = (lambda n=name: onto_file[n]) if onto_file else None
            self.layers[name].table.load(as_full(name, part, onto, where), self.optimizer)

    def resume(self, step: int | None) -> None:
        """Nothing: each replica holds its own step."""

    def commit_load(self) -> None:
        """Nothing: a module's load loads its replica itself."""


def exchange(mine: list[Lookups], workers: int) -> tuple[list[list[Lookups]], int]:
    """All-gather this worker's `Lookups` of each table: each table's parts of every worker, in worker order, and
    the bytes this worker sent (to each of the W-1 others). Every worker must reach it, with the same tables."""
    counts = torch.tensor([[p.ids.numel(), p.grad_ids.numel()] for p in mine])
    every_count = [c.reshape(-1, 2) for c in gather(counts.reshape(-1), [counts.numel()] * workers)]
    lengths = [int((2 * c[:, 0] + c[:, 1]).sum()) for c in every_count]
    ints = gather(torch.cat([torch.cat([p.ids, p.occurrences, p.grad_ids]) for p in mine]), lengths)
    padded_bytes = 8 * (counts.numel() + max(lengths))  # what this worker sends each other worker
    floats = {}
    for dtype in dict.fromkeys(p.grads.dtype for p in mine):
        tables = [t for t, p in enumerate(mine) if p.grads.dtype == dtype]
        lengths = [sum(int(c[t, 1]) * mine[t].grads.shape[1] for t in tables) for c in every_count]
        floats[dtype] = gather(torch.cat([mine[t].grads.reshape(-1) for t in tables]), lengths)
        padded_bytes += max(lengths) * dtype.itemsize
    every: list[list[Lookups]] = [[] for _ in mine]
    for worker, c in enumerate(every_count):
        at, float_at = 0, dict.fromkeys(floats, 0)
        for table, (n, k) in enumerate(c.tolist()):
            flat, dtype, dim = ints[worker], mine[table].grads.dtype, mine[table].grads.shape[1]
            grads = floats[dtype][worker][float_at[dtype] : float_at[dtype] + k * dim].reshape(k, dim)
            float_at[dtype] += k * dim
            every[table].append(
                Lookups(flat[at : at + n], flat[at + n : at + 2 * n], flat[at + 2 * n : at + 2 * n + k], grads)
            )
            at += 2 * n + k
    return every, (workers - 1) * padded_bytes


def gather(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Every worker's 1-D `flat`, whose length is `lengths[worker]`, in worker order (one all-gather, each part
    padded to the longest). Every worker must reach it."""
    padded = torch.cat([flat, flat.new_zeros(max(lengths) - flat.numel())])
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    return [part[:n] for part, n in zip(parts, lengths)]
