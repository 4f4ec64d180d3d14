"""Trainer: the one object a training loop uses, whichever strategy the job runs."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from gradsync import cluster, resume, scalars
from gradsync.config import ConfigError
from gradsync.core.row_optim import ROW_OPTIMIZERS
from gradsync.core.tables import element_counts
from gradsync.straggler import Straggler


class Trainer:
    """Wraps a model and an optimizer class for the job's strategy. Every worker must construct it.

    Args:
        model: the user's module, built identically on every worker (worker 0's values are used).
        optimizer_cls: any `torch.optim.Optimizer` class; it runs on the servers (ps) or locally (allreduce).
        find_unused_parameters: allreduce and hybrid: allow parameters that get no gradient in a step (a
            branch not taken); a parameter no worker used is left alone by the optimizer, as in
            single-process training. Costs a walk of the autograd graph per forward. The ps strategy
            accepts and ignores it: it does not need it.
        tables: 'auto' (default): under the ps and hybrid strategies, every `nn.Embedding` and
            `nn.EmbeddingBag` whose weight is not tied to another layer is served row by row from the
            parameter servers, and a worker pulls only the rows its batch looks up; 'dense': keep them
            in the dense path like any other parameter. Allreduce keeps the whole model in DDP.
        table_optimizer: the row-wise optimizer of the tables on the servers (`gradsync.RowSGD`,
            `gradsync.RowAdagrad`); default: `optimizer_cls` when it is exact row by row (plain SGD),
            else an error that asks for one.
        optimizer_kwargs: passed to `optimizer_cls`.

    Attributes:
        start_step: the step to continue from: 0, or the step of the checkpoint the job resumed from
            (`--resume`); loop `for step in range(trainer.start_step, steps)`.

    Uneven data (workers with different numbers of batches): train inside `with trainer.join():` (see `join`).
    """

    def __init__(self, model: nn.Module, optimizer_cls: type, *, find_unused_parameters: bool = False,
                 tables: str = "auto", table_optimizer=None, **optimizer_kwargs):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer needs a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                f"optimizer_cls must be a torch.optim.Optimizer class such as torch.optim.SGD, got {optimizer_cls!r}"
            )
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                "the model has no trainable parameters (none with requires_grad=True), so there is nothing "
                "to train: unfreeze at least one (p.requires_grad_(True)) before building the Trainer"
            )
        if tables not in ("auto", "dense"):
            raise ValueError(f"tables={tables!r}: expected 'auto' (serve embedding tables row-wise) or 'dense'")
        if table_optimizer is not None and not isinstance(table_optimizer, ROW_OPTIMIZERS):
            raise TypeError(f"table_optimizer must be gradsync.RowSGD(...) or gradsync.RowAdagrad(...), "
                            f"got {table_optimizer!r}")
        job = self._job = cluster.current()
        if job.config.is_server:
            raise RuntimeError("Trainer is for workers; servers serve inside gradsync.init()")
        job.building_trainer()
        self._model_description = resume.describe_model(model)
        elements = element_counts(model, tables)  # before a strategy takes the tables over
        if job.resumed is not None:
            resume.check_model(job.resumed, model)
        if job.config.strategy == "ps":
            from gradsync.worker.ps_strategy import PSStrategy

            self._strategy = PSStrategy(job, model, optimizer_cls, optimizer_kwargs, tables=tables,
                                        table_optimizer=table_optimizer)
        elif job.config.strategy == "hybrid":
            from gradsync.worker.hybrid_strategy import HybridStrategy

            self._strategy = HybridStrategy(job, model, optimizer_cls, optimizer_kwargs, tables=tables,
                                            table_optimizer=table_optimizer,
                                            find_unused_parameters=find_unused_parameters)
        else:
            from gradsync.worker.allreduce_strategy import AllreduceStrategy

            self._strategy = AllreduceStrategy(job, model, optimizer_cls, optimizer_kwargs,
                                               find_unused_parameters=find_unused_parameters)
        self._straggler = Straggler(job.config.worker_rank)
        self._joining = False
        scalars.watch(self, elements)
        self.start_step = 0 if job.resumed is None else resume.restore(job, self._strategy, job.resumed)

    @property
    def model(self) -> nn.Module:
        """Call it in the forward pass, inside `with dist_autograd.context()`."""
        return self._strategy.model

    @property
    def metrics(self):
        """Per-step timings and bytes (`metrics.summary()` gives medians)."""
        return self._strategy.metrics

    def step(self, context_id: int) -> None:
        """Commit the step of `context_id`, once per context, after its backward: servers apply (ps) or
        the local optimizer steps (allreduce); then, every `checkpoint_every` steps, write a checkpoint
        (every worker takes part)."""
        self._straggler.delay()
        self._strategy.step(context_id)
        self._straggler.committed()
        self._job.steps += 1
        every = self._job.config.checkpoint_every
        if every and self._job.steps % every == 0:
            resume.save(self._job, self._strategy, self._model_description)

    @contextlib.contextmanager
    def join(self):
        """A block in which workers may run out of data at different steps (the idea of
        `torch.distributed.algorithms.Join`). Every worker must train inside it:

            with trainer.join():
                for x, y in my_batches:          # as many batches as this worker has
                    with dist_autograd.context() as cid:
                        ...
                        trainer.step(cid)

        A worker that leaves the block has joined: it takes no part in the steps the others still take, and
        its exit from the block waits until every worker has joined, so all leave it with the same, final
        state (a block per epoch is fine). Each step is the mean over the workers still active in it (sync
        ps, allreduce and hybrid alike): a step with fewer workers gives each sample a larger weight, which
        with equal-size batches is single-process training on the batches left. Allreduce: the joined
        worker answers each later step's collectives with zeros and applies the same update, so it stays an
        exact replica (optimizer state included). Async ps: nothing changes but the wait at the end; ssp:
        no worker waits for a joined one, and pushes weigh 1 / the workers still active. BatchNorm
        statistics are averaged over the active workers; integer buffers come from an active one.

        Raises:
            ConfigError: with --checkpoint-every (a checkpoint needs every worker at the same step).
            RuntimeError: inside another join block; or on leaving the block, when a rank failed or fell
                silent, or a worker left the job without joining (naming it).
        """
        config = self._job.config
        if config.checkpoint_every:
            raise ConfigError(
                f"trainer.join() lets workers take different numbers of steps, and checkpoint_every="
                f"{config.checkpoint_every} needs every worker at the same step: leave out --checkpoint-every, "
                "or give every worker the same number of batches and train without trainer.join()")
        if self._joining:
            raise RuntimeError("trainer.join() is already open: leave that block before opening another")
        self._joining = True
        try:
            with self._strategy.join():
                yield
        finally:
            self._joining = False

    def server_stats(self) -> dict[int, dict]:
        """Every parameter server's counters by server index (version, pushes, staleness, bytes, and
        per embedding table: rows and bytes held, rows pulled and pushed, largest staleness); {} for
        allreduce."""
        transport = getattr(self._strategy, "transport", None)
        return {} if transport is None else transport.stats()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full current model state, keyed exactly as `model.state_dict()`."""
        return self._strategy.state_dict()
