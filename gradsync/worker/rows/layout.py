"""What a strategy asks of the model's tables trained row by row, whichever layout holds them.

Three layouts implement `RowLayout`: served by the parameter servers (`rows.served.ServedRows`: fixed and
dynamic tables, under ps and hybrid), split by row across the workers (`rows.sharded.ShardedRows`), and a
replica in every worker (`rows.replicated.ReplicatedRows`: allreduce's dynamic tables). Each is built
complete: it takes its tables out of the user's module (their lookups then go through it), with the
transport, metrics and optimizer it needs passed in.

A step, the same in every strategy whose dense layers DDP averages (hybrid, sharded, allreduce):

    rows = layout.gradients(context_id, grads, scaler)
    partials = layout.partial_norms(rows, clipping)      # with clipping or a GradScaler, else None
    coefficient = the dense part's step(context_id, scaler, partials)
    layout.end_step(layout.apply(rows, coefficient))

Under ps a step's rows travel in the same pushes as its dense gradients (the servers apply both, and answer
the norm of both): ps takes `gradients` and gives its pushes' replies to `end_step`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

from gradsync.core.buckets import TensorSpec
from gradsync.core.clipping import Clipping


class RowLayout(ABC):
    """The model's row-trained tables on one worker. `specs`: its fixed tables (`nn.Embedding`,
    `nn.EmbeddingBag`) by weight; its dynamic tables are `gradsync.DynamicEmbedding` modules."""

    specs: tuple[TensorSpec, ...]

    @property
    @abstractmethod
    def holds_dynamic(self) -> bool:
        """Whether it holds dynamic tables (a checkpoint between full ones is then a delta)."""

    def model_sizes(self, trainable: int) -> dict[str, int]:
        """What `gradsync compare --predict` models of `trainable` elements: dense, and in its fixed tables."""
        tables = sum(t.numel for t in self.specs)
        return {"dense": trainable - tables, "tables": tables}

    @abstractmethod
    def gradients(self, context_id: int | None, grads: dict[torch.Tensor, torch.Tensor], scaler=None) -> Any:
        """The step's row gradients of dist_autograd context `context_id` (`grads`: its gradients by leaf),
        unscaled by `scaler` (a GradScaler): served, each server's push; sharded, every worker's rows at their
        owners (a collective); replicated, this worker's lookups. Forgets the context's lookups."""

    @abstractmethod
    def partial_norms(self, step: Any, clipping: Clipping) -> list[float] | None:
        """The rows' parts of the step's total norm, of the rows averaged over the workers (served: the servers'
        answers, which hold the rows until `apply`); None where the rows are no part of it (replicated: as in
        one process, where no clipping of `model.parameters()` sees a DynamicEmbedding's rows)."""

    @abstractmethod
    def apply(self, step: Any, coefficient: float | None) -> Any:
        """Apply `gradients`' rows times `coefficient` (None: the dense step was dropped, the rows are not
        applied and the step counts all the same). Returns what `end_step` takes (served: the servers' replies)."""

    @abstractmethod
    def end_step(self, replies: Any = None) -> None:
        """The step's end, after every holder applied it (dynamic tables: eviction, the next step's lookups)."""

    @abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """Every table whole, keyed as the user's `model.state_dict()` holds it."""

    @abstractmethod
    def own_state(self) -> AbstractContextManager:
        """A block in which gradsync reads the modules' state itself: their hooks gather nothing."""

    def local_keys(self) -> dict[str, torch.Tensor]:
        """The dynamic tables' own (unused) keys, which `own_state` leaves out of the module's state_dict."""
        return {}

    @abstractmethod
    def checkpoint(self, delta: bool) -> dict:
        """What a worker's checkpoint file keeps of the rows (`delta`: the dynamic tables' changes since the
        last full checkpoint); {} where the servers keep them."""

    @abstractmethod
    def restore(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None) -> None:
        """Take this worker's rows from the worker files of a checkpoint (`Strategy.load_rows`); nothing where
        the servers restored them."""

    @abstractmethod
    def resume(self, step: int | None) -> None:
        """Go on after step `step` (a resume), or at the step the holders are at (None: after `trainer.join()`,
        in which a worker that ran out of data took fewer steps than the others)."""

    def settle(self) -> None:
        """Before any call on the holders but a lookup (stats, a checkpoint, a join): what waits is sent."""

    @abstractmethod
    def commit_load(self) -> None:
        """After a module's `load_state_dict` succeeded: the tables it loaded go where they are trained."""

    def discard_load(self) -> None:
        """Forget what a module's load took (it raised, was sent, or another begins)."""

    def begin_serving(self) -> None:
        """From now on the holders answer: the modules' `state_dict()` gathers the tables."""


class FixedAndDynamic(RowLayout):
    """A layout of two halves, its fixed tables (`fixed`) and its dynamic ones (`dynamic`), each with its own
    lookups, loads and state-dict hooks (served, sharded)."""

    fixed: Any
    dynamic: Any

    @property
    def holds_dynamic(self) -> bool:
        return bool(self.dynamic.modules)

    @contextlib.contextmanager
    def own_state(self):
        with not_serving(self.fixed), not_serving(self.dynamic):
            yield

    def local_keys(self) -> dict[str, torch.Tensor]:
        return self.dynamic.local_keys()

    def discard_load(self) -> None:
        self.fixed.discard_load()
        self.dynamic.discard_load()

    def begin_serving(self) -> None:
        self.fixed.serving = self.dynamic.serving = True


@contextlib.contextmanager
def not_serving(holder):
    """A block in which `holder` (tables of any layout) has `serving` off: its state-dict hooks gather nothing
    while gradsync reads the modules' state itself."""
    serving, holder.serving = holder.serving, False
    try:
        yield
    finally:
        holder.serving = serving
