"""What `gradsync.Trainer` asks of a worker-side strategy, whichever the job runs (ps, allreduce, hybrid, sharded).

Every strategy implements `Strategy`; the Trainer (and a job checkpoint,
`gradsync.runtime.checkpoints`, with `local_state` / `load_local_state` / `load_rows`) calls these
and nothing else, so it never asks which strategy it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
from torch import nn

from gradsync.metrics.step_metrics import StepMetrics


class Strategy(ABC):
    """A worker's side of one strategy. Every worker must construct it (a barrier).

    Attributes:
        model: what the training loop calls in the forward pass (inside a dist_autograd context).
        optimizer: what LR schedules drive (`Trainer.optimizer`).
        metrics: per-step timings and bytes.
        grad_norm: the total norm before clipping of the last step (with clipping; else None).
        rejoined_at: in a dead worker's replacement, the steps the job had closed before it rejoined (its
            first step is the next); None in any other process.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    metrics: StepMetrics
    grad_norm: float | None
    rejoined_at: int | None = None

    @abstractmethod
    def step(self, context_id: int, scaler=None):
        """Commit the step of `context_id` once, after its backward (see `Trainer.step`)."""

    def between_steps(self) -> None:
        """Called while this worker waits between two steps outside any collective (for the others' parts of a
        checkpoint): the allreduce strategy heals a dead worker's replacement there."""

    @abstractmethod
    def no_sync(self) -> AbstractContextManager:
        """`Trainer.no_sync`: a block whose backward passes only accumulate."""

    @abstractmethod
    def join(self) -> AbstractContextManager:
        """`Trainer.join`: a block in which workers may run out of data at different steps."""

    @abstractmethod
    def model_sizes(self, trainable: int) -> dict[str, int]:
        """What `gradsync compare --predict` models of the `trainable` elements (dense, served tables)."""

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full current model state, keyed exactly as the user's `model.state_dict()`."""

    @abstractmethod
    def local_state(self, delta: bool = False) -> dict:
        """What a job checkpoint keeps of this worker beyond its step and RNG. `delta`: the checkpoint is a
        delta onto the last full one (`checkpoint_full_every`, where `writes_deltas`)."""

    @abstractmethod
    def load_local_state(self, state: dict) -> None:
        """Take back `local_state()` from a checkpoint."""

    def load_rows(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None = None) -> None:
        """Take the table rows this worker holds from the worker files of a checkpoint (`saved`, loaded as they
        are read, the one it restores from first; `where` names the checkpoint; `full(k)`: of a delta
        checkpoint, worker k's file of the full one it goes onto, `full()` that of the file it restores from):
        nothing, unless the workers hold the tables' rows (sharded, allreduce's dynamic replicas)."""

    def server_stats(self) -> dict[int, dict]:
        """Every parameter server's counters by server index; {} without servers."""
        return {}

    def checkpoint_servers(self, directory: str, base: str | None = None) -> dict[int, tuple[str, int]]:
        """Every parameter server writes its shard into `directory`: (path, version) by server; {} without
        servers (a job checkpoint, `gradsync.runtime.checkpoints`). `base`: the folder of the last full
        checkpoint, onto which the servers' dynamic tables go as a delta."""
        return {}

    @property
    def servers_hold_dynamic(self) -> bool:
        """Whether the parameter servers hold dynamic tables, whose lookups change them (a checkpoint holds the
        workers until it is written)."""
        return False

    @property
    def writes_deltas(self) -> bool:
        """Whether a checkpoint between full ones (`checkpoint_full_every`) is a delta: dynamic tables on the
        servers, or on the workers (sharded, allreduce's replicas)."""
        return self.servers_hold_dynamic
