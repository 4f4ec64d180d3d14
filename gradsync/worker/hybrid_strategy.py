"""Worker side of the hybrid strategy: embedding tables on the parameter servers, the rest in DDP.

The recommendation-model layout (PERSIA, HugeCTR): a worker pulls only the
rows of the tables its batch looks up (`worker.served_tables`), and the dense layers
are averaged by DDP among the workers, in the same dist_autograd loop. `step`
applies the dense optimizer (`AllreduceStrategy.step`, with its checks and
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
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from gradsync.core.buckets import ModelSpec
from gradsync.core.clipping import Clipping
from gradsync.core.errors import NoTablesToServe
from gradsync.core.optimizer_spec import OptimizerSpec, changed_options, group_options
from gradsync.membership.uneven_data import Joiner
from gradsync.ps.messages import Agreement, Partial, Push, Setup, Snapshot
from gradsync.transport.registry import transport
from gradsync.worker.allreduce_strategy import AllreduceStrategy
from gradsync.worker.amp import inverse_scale
from gradsync.worker.model_state import ordered
from gradsync.worker.plain_module import Attachments
from gradsync.worker.served_dynamic import find_dynamic, serve_dynamic
from gradsync.worker.served_tables import serve_tables, why_dense
from gradsync.worker.strategy import Strategy

if TYPE_CHECKING:
    from gradsync.runtime.cluster import Cluster


class HybridStrategy(Strategy):
    """Served tables + DDP. Every worker must construct it (a barrier on the servers and in DDP)."""

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
        dense = why_dense(module, tables, spec, table_optimizer)
        if dense is not None and not find_dynamic(module):  # before any table is taken over or said
            raise NoTablesToServe(
                f"the hybrid strategy serves embedding tables from the parameter servers, and {dense}"
            )
        self.attached = Attachments()  # what the module's own copies, saves and loads see (`plain_module`)
        self.tables, setups = serve_tables(
            module, tables, config.servers, None, spec, table_optimizer, send=worker == 0, attached=self.attached
        )
        chosen = transport(config.transport)
        self.dynamic = serve_dynamic(
            module, chosen.capabilities, config, table_optimizer, setups if worker == 0 else None, self.attached
        )
        self.servers = list(range(config.servers))
        self.transport = chosen.worker(config, cluster.store, {s: [] for s in self.servers})
        self.tables.transport = self.dynamic.transport = self.transport
        self.transport.register(
            ModelSpec((), (), (), self.tables.specs),
            {
                s: Setup.of([], {}, {}, {}, spec, setups[s], config.servers) if worker == 0 else None
                for s in self.servers
            },
        )
        served = {id(weights[t.name]) for t in self.tables.specs}
        for group in optimizer.param_groups:  # the servers train the tables: the local optimizer keeps the rest
            group["params"] = [p for p in group["params"] if id(p) not in served]
        self.dense = AllreduceStrategy(
            cluster,
            module,
            optimizer,
            find_unused_parameters=find_unused_parameters,
            clipping=clipping,
            replicate_dynamic=False,
        )
        self.model = self.dense.model
        self.optimizer = optimizer
        self._sent = [group_options(g) for g in optimizer.param_groups]  # the options the servers hold
        self.tables.serving = self.dynamic.serving = True
        self.metrics = self.dense.metrics
        self.tables.metrics = self.dynamic.metrics = self.metrics  # lookups count as pull, not compute
        self._versions = {s: 0 for s in self.servers}
        self.joiner = Joiner(cluster.store, cluster.config, cluster.heartbeat, self.servers)
        self.loads = 0  # the table loads sent to the servers (`_commit_load`)
        self.attached.on_load(module.modules(), (self.tables, self.dynamic), self._commit_load)
        cluster.leaving.append(self.attached.detach)

    def _commit_load(self) -> None:
        """After the module's `load_state_dict` succeeded (DDP's dense layers loaded in place): the tables it
        loaded go to the servers (numbered: each server takes a load once), the dynamic ones too."""
        if self.tables.loaded:
            self.loads += 1
            self.transport.load_values(self.loads, {s: ([], self.tables.loaded_rows(s)) for s in self.servers})
            self.tables.discard_load()
        self.dynamic.commit_load()

    # the base declares an attribute; here a read-only view of the dense part's, which nothing sets
    @property
    def grad_norm(self) -> float | None:  # type: ignore[override]
        return self.dense.grad_norm

    def step(self, context_id: int, scaler=None) -> None:
        """Apply the dense optimizer to the averaged gradients and push the row gradients to the servers; with
        clipping or a GradScaler (sync), the rows first, held by the servers until the joint norm is known."""
        by_leaf = dist_autograd.get_gradients(context_id)
        rows = self.tables.row_grads(context_id, by_leaf)
        for s, per in self.dynamic.row_grads(context_id, by_leaf).items():
            rows[s].update(per)
        changes = changed_options(self.optimizer.param_groups, self._sent)  # a schedule's, for the rows' lr
        if changes:
            self._sent = [group_options(g) for g in self.optimizer.param_groups]
        if scaler is not None or self.dense.clipping.on:
            if self.mode != "sync":
                raise ValueError(f"a GradScaler under the hybrid strategy needs --mode sync; got --mode {self.mode}")
            unscale = inverse_scale(scaler)
            rows = {s: {t: r.times(unscale) for t, r in per.items()} for s, per in rows.items()}
            agree = Agreement(self.dense.clipping.norm_type, scaler is not None)
            # with `agree`, every server answers its part of the held step's norm
            partials = cast(
                "dict[int, Partial]",
                self.transport.push(
                    self._versions, {s: Push([], [], {}, rows[s], changes, agree) for s in self.servers}
                ),
            )
            coefficient = self.dense.dense_step(context_id, scaler, [partials[s].value for s in self.servers])
            snapshots: dict[int, Snapshot] | dict[int, Snapshot | Partial]
            snapshots = self.transport.finish({s: p.version for s, p in partials.items()}, coefficient)
        else:
            if not self.dense.step(context_id):  # a NaN/Inf step dropped by nonfinite='skip': drop its rows too
                rows = {s: {} for s in self.servers}
            snapshots = self.transport.push(
                self._versions, {s: Push([], [], {}, rows[s], changes) for s in self.servers}
            )
        self._versions = {s: snap.version for s, snap in snapshots.items()}
        self.dynamic.end_step(snapshots)
        self.metrics.sent_after_commit(sum(r.nbytes for per in rows.values() for r in per.values()))

    def model_sizes(self, trainable: int) -> dict[str, int]:
        return self.tables.model_sizes(trainable)

    def server_stats(self) -> dict[int, dict]:
        self.dynamic.send_evictions()
        return self.transport.stats()

    def checkpoint_servers(self, directory: str, base: str | None = None) -> dict[int, tuple[str, int]]:
        self.dynamic.send_evictions()
        return self.transport.checkpoint(directory, base)

    @property
    def servers_hold_dynamic(self) -> bool:
        return bool(self.dynamic.modules)

    def no_sync(self):
        """`Trainer.no_sync`: the dense part's DDP accumulates; rows travel once per step anyway."""
        return self.dense.no_sync()

    @contextlib.contextmanager
    def join(self):
        """`Trainer.join`: allreduce's join for the dense layers, the servers told before it answers the others'
        dense steps (with the dynamic tables' last evictions: a worker that joined earlier looks up next without
        them); then the servers' versions, for the next push, and the step of their dynamic tables."""
        with self.dense.join(self._announce):
            yield
        self.joiner.wait()
        self.dynamic.resync()
        self._versions = {s: snap.version for s, snap in self.transport.pull().items()}

    def _announce(self) -> None:
        self.dynamic.send_evictions()
        self.joiner.announce()

    def local_state(self, delta: bool = False) -> dict:
        """What a checkpoint keeps of this worker: the dense part's model and optimizer state (the servers keep
        the tables and their row optimizer state)."""
        with self.tables.own_state(), self.dynamic.own_state():
            return self.dense.local_state()

    def load_local_state(self, state: dict) -> None:
        """Take back `local_state()` (the dynamic tables' local keys, which it leaves out, as they are); the next
        push goes at the versions the restored servers hold, the next lookups at their step."""
        with self.tables.own_state(), self.dynamic.own_state():
            self.dense.load_local_state({**state, "model": {**self.dynamic.local_keys(), **state["model"]}})
        self.dynamic.resync()
        self._versions = {s: snap.version for s, snap in self.transport.pull().items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        named = {s: named for s, (_, _, named) in self.transport.state().items()}
        tables = {**self.tables.whole_tables(named), **self.dynamic.state()}
        with self.tables.own_state(), self.dynamic.own_state():
            return ordered(self.dense.state_dict(), tables, self.keys)
