"""Trainer: the one object a training loop uses, whichever strategy the job runs."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from gradsync.config import ConfigError
from gradsync.core.clipping import Clipping
from gradsync.core.errors import outside_context_error
from gradsync.core.optimizer_spec import as_optimizer
from gradsync.core.torch_internals import current_context_id
from gradsync.metrics import scalars
from gradsync.runtime import checkpoints, cluster, replacement
from gradsync.runtime.straggler import straggler_of
from gradsync.tables.row_optim import ROW_OPTIMIZERS
from gradsync.worker.module.user_optimizer import watch_clipping

if TYPE_CHECKING:  # the strategy's module is imported when the job's strategy is known
    from gradsync.worker.strategies.strategy import Strategy


class Trainer:
    """Wraps a model and its optimizer for the job's strategy. Every worker must construct it.

    Args:
        model: the user's module, built identically on every worker (worker 0's values are used). After
            every step it holds the values the next forward uses, under every strategy.
        optimizer: a `torch.optim.Optimizer` instance over `model.parameters()` or parameter groups (any
            class, every group's options), built before the Trainer as in a single-process loop; or, the
            older form, an optimizer class followed by its keyword arguments (`Trainer(model,
            torch.optim.SGD, lr=0.1)`). Under ps every server builds the same class with the same groups
            over its shard; under allreduce the instance is used as it is.
        max_grad_norm: clip the step's gradient to this total norm, as `torch.nn.utils.clip_grad_norm_` on
            the joint batch's gradient (None: no clipping; float('inf') measures the norm only). Sync ps:
            the servers agree on the norm across their shards before any applies; allreduce: the norm of the
            averaged gradient; async and ssp ps: each push is clipped by its own norm.
        grad_norm_type, error_if_nonfinite: as `clip_grad_norm_`'s `norm_type` and `error_if_nonfinite`.
        find_unused_parameters: allreduce and hybrid: allow parameters that get no gradient in a step (a
            branch not taken); a parameter no worker used is left alone by the optimizer, as in
            single-process training. Costs a walk of the autograd graph per forward. The ps strategy
            accepts and ignores it: it does not need it.
        tables: under the ps, hybrid and sharded strategies, which `nn.Embedding` / `nn.EmbeddingBag` weights
            (not tied to another layer) are served row by row from the servers (sharded: split by row across
            the workers), a worker pulling only the rows its batch looks up: 'auto' (default) those a row
            optimizer applies to (`table_optimizer`, or the exact row-wise form of their group's optimizer:
            plain SGD), the others stay dense, said once; 'rows': all of them (refused for a table without a
            row optimizer); 'dense': none. Allreduce keeps the whole model in DDP.
        table_optimizer: the row-wise optimizer of the served tables and of the model's
            `gradsync.DynamicEmbedding` tables (`gradsync.RowSGD`, `gradsync.RowAdagrad`); required with a
            DynamicEmbedding, whose rows ps and hybrid keep on the servers, allreduce as a replica per
            worker (`worker/rows/replicated.py`) and sharded split over the workers by id
            (`worker/rows/sharded_dynamic.py`).
        optimizer_kwargs: with an optimizer class: its keyword arguments.

    Attributes:
        start_step: the step to continue from: 0, or the step of the checkpoint the job resumed from
            (`--resume`); loop `for step in range(trainer.start_step, steps)`.

    Uneven data (workers with different numbers of batches): train inside `with trainer.join():` (see `join`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer=None,
        *,
        max_grad_norm: float | None = None,
        grad_norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        find_unused_parameters: bool = False,
        tables: str = "auto",
        table_optimizer=None,
        optimizer_cls=None,
        **optimizer_kwargs,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer needs a torch.nn.Module, got {type(model).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                "the model has no trainable parameters (none with requires_grad=True), so there is nothing "
                "to train: unfreeze at least one (p.requires_grad_(True)) before building the Trainer"
            )
        if tables not in ("auto", "rows", "dense"):
            raise ValueError(
                f"tables={tables!r}: expected 'auto' (serve the tables a row optimizer applies to), "
                "'rows' (serve every table) or 'dense'"
            )
        if table_optimizer is not None and not isinstance(table_optimizer, ROW_OPTIMIZERS):
            raise TypeError(
                f"table_optimizer must be gradsync.RowSGD(...) or gradsync.RowAdagrad(...), got {table_optimizer!r}"
            )
        clipping = Clipping(max_grad_norm, grad_norm_type, error_if_nonfinite)
        optimizer = as_optimizer(model, optimizer if optimizer is not None else optimizer_cls, optimizer_kwargs)
        job = self._job = cluster.current()
        if job.config.is_server:
            raise RuntimeError("Trainer is for workers; servers serve inside gradsync.init()")
        job.building_trainer()
        self._described = checkpoints.describe(model, optimizer)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if job.resumed is not None and job.config.worker_rank == 0:  # one worker decides: one failure
            checkpoints.check(job.resumed, self._described)
        self._strategy: Strategy
        from gradsync.core.strategies import traits

        strategy = traits(job.config.strategy)  # its class's module is imported now, the others' never
        given = dict(
            tables=tables,
            table_optimizer=table_optimizer,
            find_unused_parameters=find_unused_parameters,
            clipping=clipping,
        )
        self._strategy = strategy.load()(job, model, optimizer, **{k: given[k] for k in strategy.keywords})
        watch_clipping(say=job.config.worker_rank == 0)
        straggler = straggler_of(job.config.worker_rank)  # compare --straggler naming this worker, else None
        self._commit = self._strategy.step if straggler is None else straggler.slowed(self._strategy.step)
        self._joining = False
        scalars.watch(self._strategy.metrics, self._strategy.model_sizes(trainable))
        self.start_step = 0
        self._continues = False  # a replacement before its first step (its GradScaler takes the others' state)
        if job.config.replacement:  # a dead worker's replacement: at the step in flight
            self.start_step = job.steps = replacement.rejoin(job, self._strategy, self._described)
            self._continues = self.start_step > (job.resumed.step if job.resumed is not None else 0)
        elif job.resumed is not None:
            self.start_step = job.steps = checkpoints.restore(job.config, self._strategy, job.resumed)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer instance the user built (the same object, under every strategy), which LR schedules
        drive: `param_groups` in the user's order with the user's keys (a change takes effect from the next step,
        on every server); `state_dict()` keyed as the single-process optimizer's, `load_state_dict()` (under ps
        they answer with the state the servers hold). Its `step()` runs inside `trainer.step` only: called
        anywhere else it refuses. Every worker must drive it alike."""
        return self._strategy.optimizer

    @property
    def grad_norm(self) -> float | None:
        """The total gradient norm before clipping of the last step (with max_grad_norm; else None)."""
        return self._strategy.grad_norm

    @property
    def model(self) -> nn.Module:
        """Call it in the forward pass, inside `with dist_autograd.context()`."""
        return self._strategy.model

    @property
    def metrics(self):
        """Per-step timings and bytes (`metrics.summary()` gives medians); with GRADSYNC_TIMELINE,
        `metrics.timeline.steps`: each step's pieces, when they left, were applied and came back."""
        return self._strategy.metrics

    def step(self, context_id: int, scaler: torch.amp.GradScaler | None = None) -> None:
        """Commit the step of `context_id`, once per context, after its backward: servers apply (ps) or
        the local optimizer steps (allreduce); then, every `checkpoint_every` steps, write a checkpoint
        (every worker takes part).

        Args:
            scaler: the `torch.amp.GradScaler` whose `scaler.scale(loss)` the backward ran on: the step
                unscales the gradients before clipping, is skipped on every worker and server when they hold
                an inf/NaN, and updates the scale (the GradScaler loop's unscale_, step and update in one).
        """
        if current_context_id() != context_id:
            raise outside_context_error(context_id)
        job = self._job
        if job.config.replaces_workers:  # for a replacement, should this worker die in this step
            replacement.record(job.store, job.config.worker_rank, job.steps)
        used: torch.amp.GradScaler | replacement.ContinuedScaler | None = scaler
        if self._continues and scaler is not None:  # a replacement's first step: the others' scaler state
            used = replacement.ContinuedScaler(scaler, replacement.scaler_after(job.store, job.config, job.steps - 1))
        self._continues = False
        self._commit(context_id, used)
        if job.config.restarts_workers and scaler is not None:
            replacement.record_scaler(job.store, job.config.worker_rank, job.steps, scaler)
        self._job.steps += 1
        every = self._job.config.checkpoint_every
        if every and self._job.steps % every == 0:
            checkpoints.save(
                self._job.store,
                self._job.config,
                self._job.run,
                self._job.steps,
                self._strategy,
                self._described,
                self.start_step,
            )

    def no_sync(self):
        """A block whose backward passes only accumulate, as DDP's `no_sync()`: wrap every micro-batch of a
        context but the last, and allreduce (and hybrid) exchange the gradients once per step instead of once
        per backward. The ps strategy pushes once per step anyway; inside the block it sends nothing during
        the backward (`gradsync.worker.pipeline.streaming`).

            with dist_autograd.context() as cid:
                with trainer.no_sync():
                    for x, y in micro_batches[:-1]:
                        dist_autograd.backward(cid, [loss_of(x, y) / n])
                dist_autograd.backward(cid, [loss_of(*micro_batches[-1]) / n])
                trainer.step(cid)
        """
        return self._strategy.no_sync()

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
                "or give every worker the same number of batches and train without trainer.join()"
            )
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
        return self._strategy.server_stats()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full current model state, keyed exactly as `model.state_dict()`."""
        return self._strategy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """The inverse of `state_dict()` (or of a single-process `model.state_dict()`): the values go where they
        are trained (servers, tables' owners, replicas), as the user's `model.load_state_dict(state)` does.
        Every worker loads the same state, as under DDP."""
        module = cast(nn.Module, self._strategy.model.module)  # the user's module under every strategy
        return module.load_state_dict(state, strict=strict)
