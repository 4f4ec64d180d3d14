"""Worker side of the sharded strategy: embedding tables split across the workers by row, the rest in DDP.

The layout TorchRec, HugeCTR and the DLRM reference run: no parameter server; every table that `tables=`
trains row by row (`rows.choice.choose_tables`, the rules of ps and hybrid) is split across the W workers
(`tables.row_partition`), looked up with all-to-all exchanges of ids and rows in the forward and of row
gradients at the step, and updated by the rows' owners with the row optimizer (`worker.rows.sharded`); the
dense layers are `AllreduceStrategy`'s (DDP, clipping, AMP, accumulation, the NaN/Inf checks). Sync only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from gradsync.core.clipping import Clipping
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.worker.module.plain_module import Attachments
from gradsync.worker.rows.choice import needed_tables
from gradsync.worker.rows.sharded import ShardedRows
from gradsync.worker.strategies.allreduce_strategy import AllreduceStrategy, wait_for_trainers
from gradsync.worker.strategies.dense_and_rows import DenseAndRows

if TYPE_CHECKING:
    from gradsync.runtime.cluster import Cluster


class ShardedStrategy(DenseAndRows):
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
        chosen, row_options = needed_tables(
            module,
            tables,
            spec,
            table_optimizer,
            config.worker_rank == 0,
            "the sharded strategy splits embedding tables across the workers",
        )
        split = {id(table.weight) for table in chosen.values()}
        self.metrics = StepMetrics()
        self.attached = Attachments()  # what the module's own copies, saves and loads see (`plain_module`)
        wait_for_trainers(cluster)  # each worker's rows of worker 0's values come in a collective
        self.rows = ShardedRows(
            module,
            chosen,
            row_options,
            config=config,
            table_optimizer=table_optimizer,
            optimizer=optimizer,
            metrics=self.metrics,
            attached=self.attached,
        )  # before DDP: it averages what is left
        for group in optimizer.param_groups:  # the owners train the tables: the local optimizer keeps the rest
            group["params"] = [p for p in group["params"] if id(p) not in split]
        self.dense = AllreduceStrategy(
            cluster,
            module,
            optimizer,
            find_unused_parameters=find_unused_parameters,
            clipping=clipping,
            replicate_dynamic=False,
            metrics=self.metrics,
        )
        self.attached.on_load(module.modules(), (self.rows,), self.rows.commit_load)
        cluster.leaving.append(self.attached.detach)
        dist.barrier()  # every worker answers gathers before any asks (tables on the meta device exchange nothing)
        self.model = self.dense.model
        self.optimizer = optimizer
        self.rows.begin_serving()

    def join(self):
        """Refused: a lookup is an exchange with every worker, which a worker out of data cannot answer."""
        raise NotImplementedError(
            "trainer.join() is not supported under the sharded strategy: every lookup exchanges ids and rows with "
            "every worker, so a worker that ran out of data would stall the others; give every worker the same "
            "number of batches (drop_last, or DistributedSampler), or use --strategy hybrid"
        )
