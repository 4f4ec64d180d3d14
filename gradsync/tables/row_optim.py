"""Row-wise optimizers for embedding tables: each step touches only the rows a push carries.

A table's rows live on the servers; a step sees the unique rows that the
workers looked up and their gradients (duplicates summed, averaged over W in
sync mode). `RowSGD` is `torch.optim.SGD` restricted to those rows (momentum
state is allocated for a row on its first update; a row not in a step does
not move, where dense SGD would keep moving it with its momentum).
`RowAdagrad` is row-wise Adagrad as used for recommendation tables: one
accumulator per row, of the mean squared gradient over the row.

The user passes one as `Trainer(..., table_optimizer=RowAdagrad(lr=0.05))`;
it travels to the servers, which call `new_state` and `step`.
"""

from __future__ import annotations

import dataclasses

import torch


class LazyRows:
    """Per-row state of `dim` values, allocated (as zeros) on a row's first update: a slot index per row
    (4 bytes) and the slots in use."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype):
        self.slot = torch.full((rows,), -1, dtype=torch.int32)
        self.data = torch.zeros((0, dim), dtype=dtype)
        self.used = 0

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each of the unique local row `ids`, allocating zeros for rows seen the first time."""
        slots = self.slot[ids].long()
        new = slots < 0
        count = int(new.sum())
        if count:
            if self.used + count > self.data.shape[0]:
                grown = max(self.used + count, 2 * self.data.shape[0], 1024)
                self.data = torch.cat([self.data, self.data.new_zeros(grown - self.data.shape[0], self.data.shape[1])])
            fresh = torch.arange(self.used, self.used + count)
            slots[new] = fresh
            self.slot[ids[new]] = fresh.to(torch.int32)
            self.used += count
        return slots

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes + self.used * self.data.shape[1] * self.data.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the state, for a checkpoint."""
        return {"slot": self.slot.clone(), "data": self.data[: self.used].clone()}


@dataclasses.dataclass(frozen=True)
class RowSGD:
    """SGD on the rows of a step: w -= lr * (g + weight_decay * w), with momentum per row (torch.optim.SGD's
    rule, dampening 0) allocated lazily."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        _check(self, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.nesterov and self.momentum <= 0:
            raise ValueError(f"RowSGD(nesterov=True) needs momentum > 0, got momentum={self.momentum}")

    def new_state(self, rows: int, dim: int, dtype: torch.dtype) -> LazyRows | None:
        return LazyRows(rows, dim, dtype) if self.momentum else None

    def state_bytes(self, rows: int, dim: int, dtype: torch.dtype) -> int:
        """Bytes `new_state` takes up front (momentum rows are added as rows are first updated)."""
        return 4 * rows if self.momentum else 0

    @torch.no_grad()
    def step(self, values: torch.Tensor, state: LazyRows | None, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Update the unique local rows `ids` of `values` with their gradients `grads`."""
        w = values.index_select(0, ids)
        g = grads if not self.weight_decay else grads.add(w, alpha=self.weight_decay)
        if state is not None:
            slots = state.slots(ids)
            buf = state.data[slots].mul_(self.momentum).add_(g)
            state.data[slots] = buf
            g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
        values.index_copy_(0, ids, w.add_(g, alpha=-self.lr))


@dataclasses.dataclass(frozen=True)
class RowAdagrad:
    """Row-wise Adagrad: acc[r] += mean(g_r ** 2); w_r -= lr * g_r / (sqrt(acc[r]) + eps), one accumulator
    per row (4 bytes), starting at `initial_accumulator_value`."""

    lr: float
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self):
        _check(
            self,
            lr=self.lr,
            eps=self.eps,
            weight_decay=self.weight_decay,
            initial_accumulator_value=self.initial_accumulator_value,
        )

    def new_state(self, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), self.initial_accumulator_value, dtype=torch.float32)

    def state_bytes(self, rows: int, dim: int, dtype: torch.dtype) -> int:
        return 4 * rows

    @torch.no_grad()
    def step(self, values: torch.Tensor, state: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor) -> None:
        w = values.index_select(0, ids)
        g = grads if not self.weight_decay else grads.add(w, alpha=self.weight_decay)
        acc = state.index_select(0, ids).add_(g.float().pow(2).mean(1))
        state.index_copy_(0, ids, acc)
        values.index_copy_(0, ids, w.sub_(g * (self.lr / (acc.sqrt() + self.eps)).to(w.dtype).unsqueeze(1)))


ROW_OPTIMIZERS = (RowSGD, RowAdagrad)
RowOptimizer = RowSGD | RowAdagrad
"""A row optimizer of `ROW_OPTIMIZERS`."""


def saved_state(state: LazyRows | torch.Tensor | None) -> dict[str, torch.Tensor] | torch.Tensor | None:
    """A copy of a row optimizer's `new_state` for a checkpoint: tensors only (`take_saved_state` reads it)."""
    if isinstance(state, LazyRows):
        return state.tensors()
    return None if state is None else state.clone()


def take_saved_state(state: LazyRows | torch.Tensor | None, local: torch.Tensor, saved, picked: torch.Tensor) -> None:
    """Put the saved state (`saved_state`) of the saved rows `picked` into `state` at the local rows `local`:
    an accumulator per row (RowAdagrad) is copied, momentum rows (RowSGD) get slots here, in the order of
    `local`, for the rows that had one."""
    if isinstance(state, LazyRows):
        slots = saved["slot"][picked].long()
        stepped = slots >= 0
        if stepped.any():
            fresh = state.slots(local[stepped])  # may grow `data`: index it after
            state.data[fresh] = saved["data"][slots[stepped]]
    elif state is not None:
        state[local] = saved[picked]


def _check(optimizer, **values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or value < 0 or (name == "lr" and value == 0):
            raise ValueError(
                f"{type(optimizer).__name__}({name}={value!r}): expected a number {'> 0' if name == 'lr' else '>= 0'}"
            )


ROW_NEUTRAL_SGD = ("lr", "initial_lr", "foreach", "fused", "differentiable")
"""The torch.optim.SGD options that keep it exact row by row; any other set (momentum, weight decay, nesterov,
dampening, maximize) moves rows a batch does not touch or changes the rule."""


def _inexact_sgd(options: dict) -> dict:
    """The options set in an SGD group that keep it from an exact row-wise form."""
    return {k: v for k, v in options.items() if k not in ROW_NEUTRAL_SGD and v}


def exact_row_optimizer(optimizer_cls: type, options: dict) -> RowSGD | None:
    """The row optimizer that computes what `optimizer_cls` with these group `options` computes on a table,
    when there is one: plain SGD (no momentum, no weight decay) is exact row by row; None for the rest."""
    if optimizer_cls is torch.optim.SGD and not _inexact_sgd(options):
        return RowSGD(lr=float(options["lr"]))
    return None


def inexact_part(optimizer_cls: type, options: dict) -> str:
    """What keeps `optimizer_cls` with these group `options` from an exact row-wise form, as code: SGD with the
    options that do ('SGD(momentum=0.9)'), or the class ('AdamW')."""
    if optimizer_cls is torch.optim.SGD:
        return f"SGD({', '.join(f'{k}={v!r}' for k, v in _inexact_sgd(options).items())})"
    return optimizer_cls.__name__


def no_row_form(optimizer_cls: type, options: dict, table: str) -> str:
    """Why table `table` cannot be served row by row with this optimizer, and the ways out."""
    shown = {
        k: v
        for k, v in options.items()
        if k not in ("foreach", "fused", "differentiable", "capturable") and v not in (None, False)
    }
    return (
        f"embedding table {table!r} has no exact row-wise form under "
        f"{optimizer_cls.__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())}): rows a batch does not "
        "touch would move in dense training (momentum, weight decay, Adam's moments). To serve it row by row, "
        "give it a row optimizer: Trainer(..., table_optimizer=gradsync.RowSGD(lr=..., momentum=...)) or "
        "gradsync.RowAdagrad(lr=...); or keep it dense with Trainer(..., tables='dense')"
    )
