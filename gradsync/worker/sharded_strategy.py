"""Worker side of the sharded strategy: embedding tables split across the workers by row, the rest in DDP.

The layout TorchRec, HugeCTR and the DLRM reference run: no parameter server; every table that `tables=`
trains row by row (`served_tables.choose_tables`, the rules of ps and hybrid) is split across the W workers
(`tables.row_partition`), looked up with all-to-all exchanges of ids and rows in the forward and of row
gradients at the step (`worker.sharded_tables`), and updated by the rows' owners with the row optimizer; the
dense layers are `AllreduceStrategy`'s (DDP, clipping, AMP, accumulation, the NaN/Inf checks). Sync only.

A step: the row gradients go to their owners first (each owner now holds its rows' mean over the workers);
with clipping or a GradScaler every worker gathers the owners' partial norms, and the dense step clips by the
joint norm of the dense and the table gradients; then each owner applies its rows, times the same
coefficient, unless the dense step was dropped (a NaN/Inf under nonfinite='skip' or the scaler's). A NaN/Inf
in some worker's own row gradients raises on every worker before anything is applied (nonfinite='raise'),
or drops the rows of that step (nonfinite='skip'), as hybrid's servers do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn

from gradsync.core.clipping import Clipping
from gradsync.core.errors import NoTablesToServe, nonfinite_error
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.worker.allreduce_strategy import AllreduceStrategy
from gradsync.worker.amp import inverse_scale
from gradsync.worker.model_state import ordered
from gradsync.worker.plain_module import Attachments
from gradsync.worker.served_dynamic import find_dynamic
from gradsync.worker.served_tables import choose_tables, why_dense
from gradsync.worker.sharded_dynamic import ShardedDynamic
from gradsync.worker.sharded_tables import ShardedTables
from gradsync.worker.strategy import Strategy

if TYPE_CHECKING:
    from gradsync.runtime.cluster import Cluster


class ShardedStrategy(Strategy):
    """Tables split by row over all-to-all + DDP. Every worker must construct it (collectives)."""

    def __init__(
        self,
        cluster: Cluster,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        tables: str = "auto",
        table_optimizer=None,
        find_unused_parameters: bool = False,
        clipping: Clipping = Clipping(),
    ):
        config = cluster.config
        self.config = config
        self.keys = list(module.state_dict().keys())
        spec = OptimizerSpec.of(optimizer, module)
        weights = {n: p for n, p in module.named_parameters()}
        dense = why_dense(module, tables, spec, table_optimizer)
        if dense is not None and not find_dynamic(module):  # before any table is taken over or said
            raise NoTablesToServe(f"the sharded strategy splits embedding tables across the workers, and {dense}")
        chosen, rows = choose_tables(module, tables, spec, table_optimizer, say=config.worker_rank == 0)
        self.dynamic = ShardedDynamic(
            module, table_optimizer, config.mode, config.worker_rank, config.num_workers, config.step_timeout
        )
        self.tables = ShardedTables(
            chosen, rows, config.worker_rank, config.num_workers, config.step_timeout, dynamic=self.dynamic.modules
        )
        self.dynamic.tables = self.tables
        values = {t.name: weights[t.name] for t in self.tables.specs}
        self.attached = Attachments()  # what the module's own copies, saves and loads see (`plain_module`)
        self.tables.take_over(self.attached)  # before DDP: it averages what is left
        self.dynamic.take_over(self.attached)
        split = {id(w) for w in values.values()}
        for group in optimizer.param_groups:  # the owners train the tables: the local optimizer keeps the rest
            group["params"] = [p for p in group["params"] if id(p) not in split]
        self.dense = AllreduceStrategy(
            cluster,
            module,
            optimizer,
            find_unused_parameters=find_unused_parameters,
            clipping=clipping,
            replicate_dynamic=False,
        )
        self.tables.take_rows(values)  # once every worker has built its Trainer (DDP's wait)
        self.attached.hook(module, module.register_forward_hook(self.tables.forward_ended))
        self.attached.on_load(module.modules(), (self.tables, self.dynamic), self._commit_load)
        cluster.leaving.append(self.attached.detach)
        dist.barrier()  # every worker answers gathers before any asks (tables on the meta device exchange nothing)
        self.model = self.dense.model
        self.optimizer = optimizer
        self.metrics = self.dense.metrics
        self.tables.metrics = self.dynamic.metrics = self.metrics
        self.tables.serving = self.dynamic.serving = True

    # the base declares an attribute; here a read-only view of the dense part's, which nothing sets
    @property
    def grad_norm(self) -> float | None:  # type: ignore[override]
        return self.dense.grad_norm

    def step(self, context_id: int, scaler=None) -> None:
        """Send the row gradients to their owners, step the dense part (with the joint norm under clipping or
        a GradScaler) and apply the owners' rows."""
        agreeing = scaler is not None or self.dense.clipping.on
        received, nonfinite = self.tables.exchange_grads(
            context_id, dist_autograd.get_gradients(context_id), inverse_scale(scaler)
        )
        if nonfinite and scaler is None:  # every worker knows it: all raise, or all drop the rows
            if self.config.nonfinite == "raise":
                table = next(iter(nonfinite))
                raise nonfinite_error(table, nonfinite[table])
            received = {}
        dynamic = self.dynamic.admitted({n: r for n, r in received.items() if n in self.dynamic.modules})
        received = {**{n: r for n, r in received.items() if n not in dynamic}, **dynamic}
        if agreeing:
            partials = self.tables.partial_norms(received, self.dense.clipping)
            coefficient = self.dense.dense_step(context_id, scaler, partials)
        else:
            coefficient = self.dense.dense_step(context_id)
        fixed = {n: r for n, r in received.items() if n not in dynamic}
        self.tables.apply(fixed if coefficient is not None else {}, coefficient or 1.0, self.optimizer)
        if coefficient is not None:
            self.dynamic.apply(dynamic, coefficient)
        self.dynamic.end_step()

    def _commit_load(self) -> None:
        self.tables.commit_load()
        self.dynamic.commit_load()

    def model_sizes(self, trainable: int) -> dict[str, int]:
        return self.tables.model_sizes(trainable)

    def no_sync(self):
        """`Trainer.no_sync`: the dense part's DDP accumulates; the rows travel once per step anyway."""
        return self.dense.no_sync()

    def join(self):
        """Refused: a lookup is an exchange with every worker, which a worker out of data cannot answer."""
        raise NotImplementedError(
            "trainer.join() is not supported under the sharded strategy: every lookup exchanges ids and rows with "
            "every worker, so a worker that ran out of data would stall the others; give every worker the same "
            "number of batches (drop_last, or DistributedSampler), or use --strategy hybrid"
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        tables = {**self.tables.gathered_tables(), **self.dynamic.state()}
        with self.tables.own_state(), self.dynamic.own_state():
            return ordered(self.dense.state_dict(), tables, self.keys)

    @property
    def writes_deltas(self) -> bool:
        return bool(self.dynamic.modules)

    def local_state(self, delta: bool = False) -> dict:
        """What a checkpoint keeps of this worker: the dense part's model and optimizer state, its rows of
        every table with their row optimizer state, and its part of every dynamic table (`delta`: what changed
        in it since the last full checkpoint)."""
        with self.tables.own_state(), self.dynamic.own_state():
            return {
                **self.dense.local_state(),
                "rows": self.tables.checkpoint(),
                "dynamic": self.dynamic.checkpoint(full=not delta),
            }

    def load_local_state(self, state: dict) -> None:
        """Take back the dense part of `local_state()` (the dynamic tables' local keys, which it leaves out, as
        they are; the rows come with `load_rows`)."""
        with self.tables.own_state(), self.dynamic.own_state():
            self.dense.load_local_state({**state, "model": {**self.dynamic.local_keys(), **state["model"]}})
        self.tables.applied = state["step"]

    def load_rows(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None = None) -> None:
        """Take this worker's rows and ids from the checkpoint's worker files `saved` (`ShardedTables.restore`,
        `ShardedDynamic.restore`: by the row partition and the id hash of this job's workers, whatever number of
        workers wrote them; a delta's dynamic parts onto those of worker files `full(k)`), reading each file
        once, and no more of them than those need."""
        read: list[dict] = []
        files = _kept(saved, read)
        self.tables.restore((state["rows"] for state in files), where)
        base = full and (lambda k: full(k).get("dynamic", {}))
        self.dynamic.restore((state.get("dynamic", {}) for state in itertools.chain(read, files)), where, base)


def _kept(files: Iterable[dict], read: list[dict]) -> Iterator[dict]:
    """`files`, each one appended to `read` as it is read (`load_rows` reads each file once)."""
    for state in files:
        read.append(state)
        yield state
