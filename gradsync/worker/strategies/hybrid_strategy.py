"""Worker side of the hybrid strategy: embedding tables on the parameter servers, the rest in DDP.

The recommendation-model layout (PERSIA, HugeCTR): a worker pulls only the
rows of the tables its batch looks up (`worker.rows.served`), and the dense layers
are averaged by DDP among the workers, in the same dist_autograd loop. `step`
applies the dense optimizer (`AllreduceStrategy.dense_step`, with its checks and
refusals) and pushes the row gradients, one call per server (none when the
dense step was dropped for a NaN/Inf under nonfinite='skip'; a NaN/Inf only in
the rows is dropped by the servers, after the dense step). In sync mode the
servers average the rows over all W workers, as single-process training on
the joint batch does; in async mode they apply each worker's rows as they come.
A worker that ran out of data (`join`) tells the servers first (so no row step
waits for it), then answers the dense steps the others still take.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from gradsync.core.buckets import ModelSpec
from gradsync.core.clipping import Clipping
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.membership.uneven_data import Joiner
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.ps.messages import Setup
from gradsync.transport.registry import transport
from gradsync.worker.module.plain_module import Attachments
from gradsync.worker.rows.choice import needed_tables
from gradsync.worker.rows.served import ServedRows
from gradsync.worker.strategies.allreduce_strategy import AllreduceStrategy
from gradsync.worker.strategies.dense_and_rows import DenseAndRows
from gradsync.worker.strategies.on_servers import OnServers

if TYPE_CHECKING:
    from gradsync.runtime.cluster import Cluster


class HybridStrategy(OnServers, DenseAndRows):
    """Served tables + DDP. Every worker must construct it (a barrier on the servers and in DDP)."""

    rows: ServedRows

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
        worker = config.worker_rank
        self.mode = config.mode
        if clipping.on and config.mode != "sync":
            raise ValueError(
                f"max_grad_norm={clipping.max_norm} under the hybrid strategy needs --mode sync (the norm adds the "
                f"servers' averaged row gradients to the dense part's); got --mode {config.mode}"
            )
        self.keys = list(module.state_dict().keys())
        spec = OptimizerSpec.of(optimizer, module)
        weights = {n: p for n, p in module.named_parameters()}
        chosen, row_options = needed_tables(
            module,
            tables,
            spec,
            table_optimizer,
            worker == 0,
            "the hybrid strategy serves embedding tables from the parameter servers",
        )
        self.servers = list(range(config.servers))
        picked = transport(config.transport)
        self.transport = picked.worker(config, cluster.store, {s: [] for s in self.servers})
        self.metrics = StepMetrics()  # lookups count as pull, not compute
        self.attached = Attachments()  # what the module's own copies, saves and loads see (`plain_module`)
        self.rows = ServedRows(
            module,
            chosen,
            row_options,
            config=config,
            capabilities=picked.capabilities,
            table_optimizer=table_optimizer,
            optimizer=optimizer,
            transport=self.transport,
            metrics=self.metrics,
            attached=self.attached,
            send=worker == 0,
        )
        self.transport.register(
            ModelSpec((), (), (), self.rows.specs),
            {
                s: Setup.of([], {}, {}, {}, spec, self.rows.setups[s], config.servers) if worker == 0 else None
                for s in self.servers
            },
        )
        served = {id(weights[t.name]) for t in self.rows.specs}
        for group in optimizer.param_groups:  # the servers train the tables: the local optimizer keeps the rest
            group["params"] = [p for p in group["params"] if id(p) not in served]
        self.dense = AllreduceStrategy(
            cluster,
            module,
            optimizer,
            find_unused_parameters=find_unused_parameters,
            clipping=clipping,
            replicate_dynamic=False,
            metrics=self.metrics,
        )
        self.model = self.dense.model
        self.optimizer = optimizer
        self.rows.begin_serving()
        self.joiner = Joiner(cluster.store, cluster.config, cluster.heartbeat, self.servers)
        self.attached.on_load(module.modules(), (self.rows,), self.rows.commit_load)
        cluster.leaving.append(self.attached.detach)

    def step(self, context_id: int, scaler=None) -> None:
        """`DenseAndRows.step`: the rows pushed to the servers after the dense step; with clipping or a
        GradScaler (sync) first, held by the servers until the joint norm is known."""
        if scaler is not None and self.mode != "sync":
            raise ValueError(f"a GradScaler under the hybrid strategy needs --mode sync; got --mode {self.mode}")
        super().step(context_id, scaler)

    @contextlib.contextmanager
    def join(self):
        """`Trainer.join`: allreduce's join for the dense layers, the servers told before it answers the others'
        dense steps (with the dynamic tables' last evictions: a worker that joined earlier looks up next without
        them); then the rows go on at the servers' step."""
        with self.dense.join(self._announce):
            yield
        self.joiner.wait()
        self.rows.resume(None)

    def _announce(self) -> None:
        self.rows.settle()
        self.joiner.announce()
