"""Trainer: the one object a training loop uses, whichever strategy the job runs."""
from __future__ import annotations

import torch
from torch import nn

from gradsync import cluster


class Trainer:
    """Wraps a model and an optimizer class for the job's strategy. Every worker must construct it.

    Args:
        model: the user's module, built identically on every worker (worker 0's values are used).
        optimizer_cls: any `torch.optim.Optimizer` class; it runs on the servers (ps) or locally (allreduce).
        optimizer_kwargs: passed to `optimizer_cls`.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type, **optimizer_kwargs):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer needs a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                f"optimizer_cls must be a torch.optim.Optimizer class such as torch.optim.SGD, got {optimizer_cls!r}"
            )
        job = cluster.current()
        if job.config.is_server:
            raise RuntimeError("Trainer is for workers; servers serve inside gradsync.init()")
        if job.config.strategy == "ps":
            from gradsync.worker.ps_strategy import PSStrategy as strategy_cls
        else:
            from gradsync.worker.allreduce_strategy import AllreduceStrategy as strategy_cls
        self._strategy = strategy_cls(job, model, optimizer_cls, optimizer_kwargs)

    @property
    def model(self) -> nn.Module:
        """Call it in the forward pass, inside `with dist_autograd.context()`."""
        return self._strategy.model

    @property
    def metrics(self):
        """Per-step timings and bytes (`metrics.summary()` gives medians)."""
        return self._strategy.metrics

    def step(self, context_id: int) -> None:
        """Commit the step of `context_id`: servers apply (ps) or the local optimizer steps (allreduce)."""
        self._strategy.step(context_id)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full current model state, keyed exactly as `model.state_dict()`."""
        return self._strategy.state_dict()
