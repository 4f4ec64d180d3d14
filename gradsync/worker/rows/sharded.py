"""The sharded layout: every row-trained table split across the workers, fixed tables by row
(`rows.sharded_tables`) and dynamic tables by id (`rows.sharded_dynamic`), looked up with all-to-all exchanges
and updated by the rows' owners with the row optimizer. Sync only.

A step: the row gradients go to their owners first (`gradients`: each owner then holds its rows' mean over the
workers); with clipping or a GradScaler every worker gathers the owners' partial norms; then each owner
applies its rows times the dense step's coefficient, unless that step was dropped. A NaN/Inf in some worker's
own row gradients raises on every worker before anything is applied (nonfinite='raise'), or drops the rows of
that step (nonfinite='skip'), as hybrid's servers do.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradsync.core.clipping import Clipping
from gradsync.core.errors import nonfinite_error
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.tables.placement import TableModule
from gradsync.worker.module.amp import inverse_scale
from gradsync.worker.module.plain_module import Attachments
from gradsync.worker.rows.choice import find_dynamic
from gradsync.worker.rows.layout import FixedAndDynamic
from gradsync.worker.rows.sharded_dynamic import ShardedDynamic
from gradsync.worker.rows.sharded_tables import ShardedTables

if TYPE_CHECKING:
    from gradsync.config import JobConfig

Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""An owner's rows of each table: (keys: local rows of a fixed table, ids of a dynamic one; their gradients)."""


@dataclasses.dataclass(frozen=True)
class ShardedStep:
    """This owner's rows of the step, fixed tables' first, then the dynamic tables' admitted ones."""

    received: Rows
    dynamic: frozenset[str]


class ShardedRows(FixedAndDynamic):
    """The tables of `module` in `chosen` (fixed, with their `row_options`: `choice.choose_tables`) and its
    dynamic tables, split across the workers. Every worker must construct it once every worker has begun its
    Trainer (it takes its rows of worker 0's values: a collective), and call every exchange. `optimizer`: the
    user's, whose groups' lr a table's exact row form follows."""

    fixed: ShardedTables
    dynamic: ShardedDynamic

    def __init__(
        self,
        module: nn.Module,
        chosen: dict[str, TableModule],
        row_options: dict[str, tuple],
        *,
        config: JobConfig,
        table_optimizer,
        optimizer: torch.optim.Optimizer,
        metrics: StepMetrics,
        attached: Attachments,
    ):
        worker, workers, timeout = config.worker_rank, config.num_workers, config.step_timeout
        weights = {name: table.weight for name, table in chosen.items()}
        self.fixed = ShardedTables(chosen, row_options, worker, workers, timeout, metrics, find_dynamic(module))
        self.dynamic = ShardedDynamic(
            module, table_optimizer, config.mode, worker, workers, timeout, self.fixed, metrics
        )
        self.specs = self.fixed.specs
        self.fixed.take_over(attached)
        self.dynamic.take_over(attached)
        self.fixed.take_rows(weights)
        attached.hook(module, module.register_forward_hook(self.fixed.forward_ended))
        self.nonfinite, self.optimizer = config.nonfinite, optimizer

    def model_sizes(self, trainable: int) -> dict[str, int]:
        return {**super().model_sizes(trainable), "sharded_tables": len(self.specs)}

    def gradients(self, context_id, grads, scaler=None) -> ShardedStep:
        """The owners' rows (a collective: `ShardedTables.exchange_grads`), a NaN/Inf in any worker's own rows
        refused or dropped on every worker alike (under a GradScaler it is the scaler's); of a dynamic table,
        the rows of the ids admitted this step."""
        received, nonfinite = self.fixed.exchange_grads(context_id, grads, inverse_scale(scaler))
        if nonfinite and scaler is None:  # every worker knows it: all raise, or all drop the rows
            if self.nonfinite == "raise":
                table = next(iter(nonfinite))
                raise nonfinite_error(table, nonfinite[table])
            received = {}
        dynamic = self.dynamic.admitted({n: r for n, r in received.items() if n in self.dynamic.modules})
        fixed = {n: r for n, r in received.items() if n not in dynamic}
        return ShardedStep({**fixed, **dynamic}, frozenset(dynamic))

    def partial_norms(self, step: ShardedStep, clipping: Clipping) -> list[float]:
        return self.fixed.partial_norms(step.received, clipping)

    def apply(self, step: ShardedStep, coefficient: float | None) -> Any:
        fixed = {n: r for n, r in step.received.items() if n not in step.dynamic}
        self.fixed.apply(fixed if coefficient is not None else {}, coefficient or 1.0, self.optimizer)
        if coefficient is not None:
            self.dynamic.apply({n: step.received[n] for n in step.dynamic}, coefficient)
        return None

    def end_step(self, replies=None) -> None:
        self.dynamic.end_step()

    def state(self) -> dict[str, torch.Tensor]:
        return {**self.fixed.gathered_tables(), **self.dynamic.state()}

    def checkpoint(self, delta: bool) -> dict:
        """This worker's rows of every table with their row optimizer state, and its part of every dynamic
        table (`delta`: what changed in it since the last full checkpoint)."""
        return {"rows": self.fixed.checkpoint(), "dynamic": self.dynamic.checkpoint(full=not delta)}

    def restore(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None) -> None:
        """This worker's rows and ids from the worker files `saved` (`ShardedTables.restore`,
        `ShardedDynamic.restore`: by the row partition and the id hash of this job's workers, whatever number of
        workers wrote them; a delta's dynamic parts onto those of worker files `full(k)`), reading each file
        once, and no more of them than those need."""
        read: list[dict] = []
        files = _kept(saved, read)
        self.fixed.restore((state["rows"] for state in files), where)
        base = full and (lambda k: full(k).get("dynamic", {}))
        self.dynamic.restore((state.get("dynamic", {}) for state in itertools.chain(read, files)), where, base)

    def resume(self, step: int | None) -> None:
        """`step`: never None (a join is refused under sharded)."""
        assert step is not None
        self.fixed.applied = step

    def commit_load(self) -> None:
        self.fixed.commit_load()
        self.dynamic.commit_load()


def _kept(files: Iterable[dict], read: list[dict]) -> Iterator[dict]:
    """`files`, each one appended to `read` as it is read (`restore` reads each file once)."""
    for state in files:
        read.append(state)
        yield state
