"""The served layout (ps and hybrid): every row-trained table on the parameter servers, fixed tables by row
(`rows.served_tables`, row r on server r % S) and dynamic tables by id (`rows.served_dynamic`), a worker pulling
the rows its batch looks up, a forward's lookups of both kinds together, one call per server.

A step's rows go to each server as one push of both kinds (`RowGrads` by table). Under hybrid this layout
pushes them itself (`partial_norms`, `apply`); under ps they travel in the dense pushes (`gradients`, then
`end_step` with the replies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from gradsync.core.clipping import Clipping
from gradsync.core.optimizer_spec import SentOptions
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.ps.messages import Agreement, DynamicSetup, Partial, Push, RowGrads, Snapshot, TableSetup
from gradsync.tables.placement import TableModule
from gradsync.worker.module.amp import inverse_scale
from gradsync.worker.module.plain_module import Attachments
from gradsync.worker.rows.layout import FixedAndDynamic
from gradsync.worker.rows.served_dynamic import ServedDynamic
from gradsync.worker.rows.served_tables import ServedTables

if TYPE_CHECKING:
    from gradsync.config import JobConfig
    from gradsync.core.transport_capabilities import Capabilities
    from gradsync.transport.base import WorkerTransport


@dataclasses.dataclass
class ServedStep:
    """A step's rows: each server's push of them ({table: `RowGrads`}), whether a GradScaler scaled them, and,
    once `partial_norms` sent them held, each server's version then."""

    pushes: dict[int, dict[str, RowGrads]]
    scaled: bool
    held: dict[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for per in self.pushes.values() for r in per.values())


class ServedRows(FixedAndDynamic):
    """The tables of `module` in `chosen` (by weight: fixed tables, with their `row_options`, the pair
    `choice.choose_tables` gives) and its dynamic tables, served through `transport`. `setups`: what
    registration sends each server of them (worker 0's, when `send`; else empty). `optimizer`: the user's,
    whose options (a schedule's lr) this layout's own pushes carry."""

    fixed: ServedTables
    dynamic: ServedDynamic

    def __init__(
        self,
        module: nn.Module,
        chosen: dict[str, TableModule],
        row_options: dict[str, tuple],
        *,
        config: JobConfig,
        capabilities: Capabilities,
        table_optimizer,
        optimizer: torch.optim.Optimizer,
        transport: WorkerTransport,
        metrics: StepMetrics,
        attached: Attachments,
        send: bool,
    ):
        servers = config.servers
        self.fixed = ServedTables(chosen, servers, metrics, transport)
        self.dynamic = ServedDynamic(
            module, servers, table_optimizer, config.mode, transport, metrics, config.worker_rank
        )
        if self.dynamic.modules and not capabilities.row_tables:
            raise ValueError(
                f"{next(iter(self.dynamic.modules))!r} is a gradsync.DynamicEmbedding, whose rows the servers "
                f"serve by id: {capabilities.rows_refusal()}"
            )
        self.specs = self.fixed.specs
        self.servers = list(range(servers))
        self.setups: dict[int, dict[str, TableSetup | DynamicSetup]] = {s: {} for s in self.servers}
        if send:
            dynamic = self.dynamic.setups()
            self.setups = {s: {**per, **dynamic} for s, per in self.fixed.setups(row_options).items()}
        self.fixed.take_over(attached)
        self.dynamic.take_over(attached)
        if chosen:
            attached.hook(module, module.register_forward_hook(self.fixed.forward_ended))
        if self.dynamic.modules:
            attached.hook(module, module.register_forward_hook(self.dynamic.forward_ended))
        self.transport, self.metrics, self.optimizer = transport, metrics, optimizer
        self._sent = SentOptions.of(optimizer.param_groups)
        self._versions: dict[int, int] | None = {s: 0 for s in self.servers}  # for this layout's next push
        self.loads = 0  # the module loads sent to the servers (`commit_load`)
        self._rejoining = False  # a dead worker's replacement, before its first step (`take_before`)

    def take_before(self, servers: frozenset[int] | None) -> None:
        """A replacement's first step: its lookups of fixed tables on `servers` read the rows as they were before
        those servers closed the step (`ParameterServer.rejoin`), and its dynamic tables' at the step some
        server has not ended (the others answer them as they answered its dead process: `ps.lookup_replay`);
        None: its first step is over."""
        self._rejoining = servers is not None
        self.fixed.before = servers or frozenset()
        if self._rejoining:
            self.dynamic.resync(newest=False)

    def gradients(self, context_id, grads, scaler=None) -> ServedStep:
        rows = self.fixed.row_grads(context_id, grads)
        for s, per in self.dynamic.row_grads(context_id, grads).items():
            rows[s].update(per)
        unscale = inverse_scale(scaler)
        if unscale != 1.0:
            rows = {s: {t: r.times(unscale) for t, r in per.items()} for s, per in rows.items()}
        return ServedStep(rows, scaler is not None)

    def partial_norms(self, step: ServedStep, clipping: Clipping) -> list[float]:
        """The rows pushed held (`Agreement`): each server answers its part of the step's norm."""
        agree = Agreement(clipping.norm_type, step.scaled)
        partials = cast("dict[int, Partial]", self._push(step.pushes, agree))
        step.held = {s: p.version for s, p in partials.items()}
        return [partials[s].value for s in self.servers]

    def apply(self, step: ServedStep, coefficient: float | None) -> dict[int, Snapshot]:
        """The held rows finished with `coefficient`, or the rows pushed (none when it is None: the servers
        count the step all the same)."""
        if step.held is not None:
            replies = self.transport.finish(step.held, coefficient)
        else:
            replies = self._push(step.pushes if coefficient is not None else {s: {} for s in self.servers})
        self._versions = {s: snap.version for s, snap in replies.items()}
        self.metrics.sent_after_commit(step.nbytes if step.held is not None or coefficient is not None else 0)
        return replies

    def _push(self, rows: dict[int, dict[str, RowGrads]], agree: Agreement | None = None) -> dict:
        changes = self._sent.take(self.optimizer.param_groups)
        if self._versions is None:  # after a resume or a join: the versions the servers are at
            self._versions = {s: snap.version for s, snap in self.transport.pull().items()}
        pushes = {s: Push([], [], {}, rows[s], changes, agree) for s in self.servers}
        return self.transport.push(self._versions, pushes)

    def end_step(self, replies=None) -> None:
        self.dynamic.end_step(replies)

    def state(self, served: dict | None = None) -> dict[str, torch.Tensor]:
        """`served`: the servers' `state()`, when the caller has it already."""
        states = served if served is not None else self.transport.state()
        return {
            **self.fixed.whole_tables({s: named for s, (_, _, named) in states.items()}),
            **self.dynamic.state(),
        }

    def checkpoint(self, delta: bool) -> dict:
        return {}

    def restore(self, saved: Iterable[dict], where: str, full: Callable[..., dict] | None) -> None:
        """Nothing: the servers restored their shards at registration."""

    def resume(self, step: int | None) -> None:
        """The dynamic tables' next lookups at the step the servers are at; the next push at their versions."""
        self.dynamic.resync(newest=not self._rejoining)
        self._versions = None

    def settle(self) -> None:
        self.dynamic.send_evictions()

    def commit_load(self, with_rows: Callable[[int], tuple[list, dict]] | None = None) -> None:
        """The fixed tables a load took go to their servers, numbered (each server takes a load once however many
        workers send it), with `with_rows(s)` (ps: server s's buckets and named values of the same load); the
        dynamic ones too."""
        if self.fixed.loaded or with_rows is not None:
            self.loads += 1
            sent = {}
            for s in self.servers:
                flats, named = with_rows(s) if with_rows is not None else ([], {})
                sent[s] = (flats, {**named, **self.fixed.loaded_rows(s)})
            self.transport.load_values(self.loads, sent)
            self.fixed.discard_load()
        self.dynamic.commit_load()
