"""What hybrid and sharded share: a strategy that is a dense part (DDP, `AllreduceStrategy.dense_step`) plus
a row layout (`worker.rows.layout.RowLayout`), stepped as the layout's protocol says."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed.autograd as dist_autograd

from gradsync.worker.module.model_state import ordered
from gradsync.worker.rows.layout import RowLayout
from gradsync.worker.strategies.allreduce_strategy import AllreduceStrategy
from gradsync.worker.strategies.strategy import Strategy


class DenseAndRows(Strategy):
    """A dense part and a row layout. A subclass builds `dense` and `rows` (its module's state_dict keys in
    `keys`, its dense part's model and optimizer as `model` and `optimizer`)."""

    dense: AllreduceStrategy
    rows: RowLayout
    keys: list[str]

    # the base declares an attribute; here a read-only view of the dense part's, which nothing sets
    @property
    def grad_norm(self) -> float | None:  # type: ignore[override]
        return self.dense.grad_norm

    def step(self, context_id: int, scaler=None) -> None:
        """The step's rows (`RowLayout.gradients`), with clipping or a GradScaler their partial norms, the dense
        step by the joint norm, then the rows applied times the dense step's coefficient."""
        rows = self.rows.gradients(context_id, dist_autograd.get_gradients(context_id), scaler)
        agreeing = scaler is not None or self.dense.clipping.on
        coefficient = self.dense.dense_step(
            context_id, scaler, self.rows.partial_norms(rows, self.dense.clipping) if agreeing else None
        )
        self.rows.end_step(self.rows.apply(rows, coefficient))

    def model_sizes(self, trainable: int) -> dict[str, int]:
        return self.rows.model_sizes(trainable)

    def no_sync(self):
        """`Trainer.no_sync`: the dense part's DDP accumulates; the rows travel once per step anyway."""
        return self.dense.no_sync()

    @property
    def writes_deltas(self) -> bool:
        return self.rows.holds_dynamic

    def state_dict(self) -> dict[str, torch.Tensor]:
        tables = self.rows.state()
        with self.rows.own_state():
            return ordered(self.dense.state_dict(), tables, self.keys)

    def local_state(self, delta: bool = False) -> dict:
        """What a checkpoint keeps of this worker: the dense part's model and optimizer state, and what the
        layout keeps of the rows (`RowLayout.checkpoint`)."""
        with self.rows.own_state():
            return {**self.dense.local_state(), **self.rows.checkpoint(delta)}

    def load_local_state(self, state: dict) -> None:
        """Take back the dense part of `local_state()` (the dynamic tables' local keys, which it leaves out, as
        they are); the layout goes on after the checkpoint's step (its rows come with `load_rows`)."""
        with self.rows.own_state():
            self.dense.load_local_state({**state, "model": {**self.rows.local_keys(), **state["model"]}})
        self.rows.resume(state["step"])

    def load_rows(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None = None) -> None:
        self.rows.restore(saved, where, full)
