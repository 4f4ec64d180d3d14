"""What a parameter server asks of its part of an embedding table, fixed (`ps.table_shard.TableShard`: rows by
index) or dynamic (`ps.dynamic_shard.DynamicShard`: rows by id), so that the server, its consistency rules,
checkpoints, restores and layouts call either the same way and never ask which it is. Callers hold the
shard's lock."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gradsync.ps.layout import TableLayout


class ServerTable(ABC):
    """One server's part of one embedding table."""

    answers_calls = False
    """Whether it answers `ps.messages.TableCall`s (a dynamic table's lookups, reads and step ends)."""

    group: int | None = None
    """The optimizer group whose learning rate its row optimizer follows (None: its own)."""

    @property
    @abstractmethod
    def stats(self):
        """Its counters (`ps.table_shard.TableStats`)."""

    @abstractmethod
    def check_push(self, worker: int, ids, grads) -> None:
        """Refuse a worker's row gradients that do not fit (a `GradientError` naming the worker and the table)."""

    @abstractmethod
    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One row optimizer step on the distinct rows `ids` with their averaged gradients."""

    def current(self, version: int, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of an async push computed at the shard's `version`, the rows it may still update: all of them, unless
        rows come and go (a dynamic table's)."""
        return ids, grads

    def closing(self, keep_before: bool) -> None:
        """A sync step closes now, before its rows are applied; `keep_before`: keep what `apply` changes, for the
        lookups of a dead worker's replacement that redoes this step (`TableShard.pull` before it). Nothing by
        default."""

    def pushed_alone(self) -> None:
        """After an async or ssp push is applied: nothing, unless the table ends its own steps there."""

    def next_end(self) -> int | None:
        """Sync: the step whose end the server answers once every push of it is in (`ps.dynamic_shard.step_end`);
        None where no step ends here."""
        return None

    def layout(self) -> TableLayout | None:
        """Its rows by index, as the endpoint shows them to the world outside the job; None where it has none."""
        return None

    def indexed_rows(self) -> torch.Tensor | None:
        """The rows it holds by local index, which the server's state and a worker's load read and write; None
        where it holds rows by id."""
        return None

    @abstractmethod
    def checkpoint(self, full: bool = True) -> dict:
        """Its part of a job checkpoint (`full` False: only what changed since the last full one, where the table
        keeps track of that; a table that does not is written whole either way)."""

    @abstractmethod
    def take(self, saved: dict) -> None:
        """Take what it holds of a `checkpoint()` written by any server of any number of servers (`ps.reshard`)."""

    @abstractmethod
    def complete(self) -> bool:
        """Whether the parts taken hold all it needs."""

    @abstractmethod
    def missing(self) -> str:
        """What the parts taken lack, in words (when not `complete`)."""

    def restored(self) -> None:
        """Once `complete`: nothing, unless the table puts the parts taken together only then."""

    def set_lr(self, lr: float) -> None:
        """A schedule set the learning rate of its `group` (told only to a table that follows one)."""
        raise NotImplementedError(f"{type(self).__name__} follows no optimizer group's learning rate")
