"""The initial rows of a dynamic table: a deterministic function of the ids, so that every process, strategy,
number of servers, arrival order and resume creates the same row for the same id."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from gradsync.tables import _table_loops
from gradsync.tables.id_hash import _signed

_INIT_WORD = 0x696E6974  # b"init": keeps the init stream apart from the admission stream of the same seed


@dataclasses.dataclass(frozen=True)
class HashedUniform:
    """gradsync's default init: element j of id's row is `(2 u - 1) / sqrt(dim)`, u in [0, 1) the
    `unit_interval` of `keyed(id, seed, b"init", j)` (tables/id_hash.py); computed in float64 (compiled:
    tables/table_loops.c), then rounded to `dtype` (float32 in the same loop).
    A dataclass, so that it pickles by value to the processes that create rows."""

    dim: int
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to("cpu", torch.int64).contiguous()
        direct = self.dtype in (torch.float32, torch.float64)  # written as they are, else cast from float64
        rows = torch.empty(flat.numel(), self.dim, dtype=self.dtype if direct else torch.float64)
        self._write(flat, torch.arange(flat.numel()), rows)
        return rows.to(self.dtype)

    def writes(self, weight: torch.Tensor) -> bool:
        """Whether `write` can write this init's rows into `weight` (rows of its dim and dtype, float32 or
        float64, contiguous)."""
        return (
            weight.dim() == 2
            and weight.shape[1] == self.dim
            and weight.dtype == self.dtype
            and self.dtype in (torch.float32, torch.float64)
            and weight.is_contiguous()
        )

    def write(self, ids: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the rows of `ids` into `weight` at `slots` directly (`writes(weight)`)."""
        self._write(ids.contiguous(), slots.contiguous(), weight)

    def _write(self, ids: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        _table_loops.hashed_uniform(
            ids.numpy(),
            slots.numpy(),
            _signed(self.seed),
            _INIT_WORD,
            self.dim**0.5,
            rows.dtype == torch.float64,
            self.dim,
            rows.numpy(),
        )


def checked_init(
    init: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, dim: int, dtype: torch.dtype, table: str
) -> torch.Tensor:
    """`init(ids)`, refused unless it is a tensor of shape [len(ids), dim] and of the table's dtype."""
    rows = init(ids)
    expected = (ids.numel(), dim)
    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != expected or rows.dtype != dtype:
        got = (
            f"a tensor of shape {list(rows.shape)} and dtype {rows.dtype}"
            if isinstance(rows, torch.Tensor)
            else f"a {type(rows).__name__}"
        )
        raise ValueError(
            f"{table}: init({ids.numel()} ids) returned {got}; it must return a tensor of shape "
            f"{list(expected)} and dtype {dtype} (one row of `dim` values per id, the table's dtype)"
        )
    return rows
