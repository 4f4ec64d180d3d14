"""One server's part of the model: flat parameter buckets, buffers, frozen parameters, optimizer, embedding
table rows (`ps.table_shard`) and version.

`ShardState` knows nothing of transports or consistency rules. It publishes
one read-only CPU copy of its buckets and buffers per version, when first asked
(`snapshot`: every pull and every push reply of that version shares it), validates incoming
gradients (`check_gradients`) and applies a gradient with the server-side
optimizer (`apply`). The optimizer sees each bucket entry as its own tensor (a
view into the bucket), and an entry that got no gradient this step has
`.grad = None`, so any `torch.optim` class skips it exactly as it would on the
model. Callers hold `lock` around anything that must see one version.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import cast

import torch

from gradsync.core import memory
from gradsync.core.buckets import Bucket
from gradsync.core.errors import GradientError
from gradsync.core.futures import failed
from gradsync.core.optimizer_spec import OptimizerSpec, apply_options, group_options, load_by_name, state_by_name
from gradsync.ps.layout import ShardLayout
from gradsync.ps.messages import Snapshot
from gradsync.ps.replica import StepJournal
from gradsync.ps.server_table import ServerTable


@dataclasses.dataclass
class ShardStats:
    """Counters a server reports (gRPC `GetStats`, `gradsync status`)."""

    version: int = 0
    workers_seen: set = dataclasses.field(default_factory=set)
    pushes_applied: int = 0
    pushes_rejected: int = 0
    steps_skipped: int = 0
    max_staleness: int = 0
    staleness_histogram: dict = dataclasses.field(default_factory=dict)  # version staleness -> applied pushes
    max_lead: int = 0  # ssp: most steps a pushing worker was ahead of the slowest
    pushes_by_worker: dict = dataclasses.field(default_factory=dict)  # async, ssp: worker -> its applied pushes
    steps_without: dict = dataclasses.field(default_factory=dict)  # worker_loss drop: step closed -> dead workers
    workers_replaced: dict = dataclasses.field(default_factory=dict)  # worker_loss wait: worker -> its replacements
    bytes_in: int = 0
    bytes_out: int = 0


class ShardState:
    """The buckets one server owns, plus its buffers, frozen parameters and optimizer."""

    def __init__(
        self,
        shard_id: int,
        buckets: list[Bucket],
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        optimizer: OptimizerSpec,
        device: torch.device | str = "cpu",
        frozen: dict[str, torch.Tensor] | None = None,
        tables: dict[str, ServerTable] | None = None,
    ):
        self.shard_id = shard_id
        self.buckets = list(buckets)
        self.device = torch.device(device)
        self.flats = [b.flatten(params).to(self.device).contiguous() for b in self.buckets]
        self.entries = [
            [e.view(flat).requires_grad_(True) for e in b.entries] for b, flat in zip(self.buckets, self.flats)
        ]
        self.params = {e.key: t for b, ts in zip(self.buckets, self.entries) for e, t in zip(b.entries, ts)}
        self.buffers = {n: t.detach().clone().to(self.device) for n, t in buffers.items()}
        self.frozen = {n: t.detach().to("cpu", copy=True) for n, t in (frozen or {}).items()}
        self.optimizer = optimizer.build(
            [(e.name, t) for b, ts in zip(self.buckets, self.entries) for e, t in zip(b.entries, ts)]
        )
        self._keys = {id(t): k for k, t in self.params.items()}
        self.tables = tables or {}
        self.lock = threading.Lock()
        self.stats = ShardStats()
        self._published: Snapshot | None = None
        self.keep_before = False  # keep `before` (a job whose dead workers are replaced: `ps.server.rejoin`)
        self.before: Snapshot | None = None  # with `keep_before`: the snapshot the last closed step began at
        self.before_options: list[dict] = []  # with `keep_before`: the groups' options the last closed step began with
        self._began_options: list[dict] | None = None  # those the step in flight began with; None: the current ones
        self.closed = 0  # steps closed (applied or skipped) since the shard was built
        self._fresh: list[torch.Tensor | None] = [None] * len(self.buckets)  # this step's pieces' replies
        self.journal: StepJournal | None = None  # replicas 1: what each step changes, for the shard's replica

    @property
    def version(self) -> int:
        return self.stats.version

    def snapshot(self) -> Snapshot:
        """The current version's CPU copy, made on the first call per version and never modified. Call with
        `lock` held."""
        if self._published is None:
            flats = [memory.cpu_copy(f) for f in self.flats]  # huge pages: a large fresh copy faults in 4 KB pages
            buffers = {n: b.to("cpu", copy=True) for n, b in self.buffers.items()}
            self._published = Snapshot(self.version, flats, buffers)
        return self._published

    def rejected(self, error: Exception) -> torch.futures.Future:
        """Count a refused push and return the failed future that answers it. Call with `lock` held."""
        self.stats.pushes_rejected += 1
        return failed(error)

    def check_gradients(self, worker: int, grads: list, absent: list, wire) -> list:
        """Validate one worker's bucket payloads in `wire`'s format (None: no gradient for the whole bucket)
        and its `absent` entry indices per bucket (their elements in the payload are zeros).
        Returns the payloads on the shard's device.

        Raises:
            GradientError: naming the bucket and the worker; nothing is changed.
        """
        if len(grads) != len(self.buckets) or len(absent) != len(self.buckets):
            raise GradientError(
                f"worker {worker} sent {len(grads)} bucket gradients ({len(absent)} absence lists) to server "
                f"{self.shard_id}, which owns {len(self.buckets)} buckets"
            )
        return [
            self.check_piece(worker, b, grad, missing, wire) for b, (grad, missing) in enumerate(zip(grads, absent))
        ]

    def check_piece(self, worker: int, b: int, grad, absent, wire):
        """Validate one worker's payload of bucket `b` (None: no gradient) and its absent entry indices;
        returns the payload on the shard's device. Raises GradientError naming the bucket and the worker."""
        if not isinstance(b, int) or not 0 <= b < len(self.buckets):
            raise GradientError(
                f"worker {worker} sent a piece of bucket {b!r} to server {self.shard_id}, which owns "
                f"buckets 0..{len(self.buckets) - 1}"
            )
        bucket = self.buckets[b]
        if any(not isinstance(i, int) or not 0 <= i < len(bucket.entries) for i in absent):
            raise GradientError(
                f"worker {worker}: bucket {bucket.index} lists absent entries {list(absent)}, "
                f"expected indices in 0..{len(bucket.entries) - 1}"
            )
        if grad is None:
            return None
        wire.validate(worker, bucket, grad)
        self.stats.bytes_in += wire.nbytes(grad)
        return wire.to_device(grad, self.device)

    def check_buffers(self, worker: int, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validate one worker's updated buffers (names, shapes, dtypes); raises GradientError."""
        for name, value in buffers.items():
            mine = self.buffers.get(name)
            if mine is None:
                raise GradientError(f"worker {worker} sent unknown buffer {name!r} to server {self.shard_id}")
            if not isinstance(value, torch.Tensor) or value.shape != mine.shape or value.dtype != mine.dtype:
                described = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value)
                raise GradientError(
                    f"worker {worker}: buffer {name!r} is {described}, expected {tuple(mine.shape)} {mine.dtype}"
                )
        return {n: v.to(self.device) for n, v in buffers.items()}

    def apply(
        self,
        grads: list[torch.Tensor | None],
        skipped: list[set[int]],
        buffers: dict[str, torch.Tensor] | None,
        rows: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """One optimizer step with these (already averaged) bucket gradients. Entries in `skipped[b]` (and
        every entry of a None bucket) had no gradient from any worker: the optimizer leaves them alone.
        `rows`: per table, the unique local rows and their (averaged) gradients, for its row optimizer.
        Call with `lock` held."""
        self.apply_buckets(dict(enumerate(grads)), dict(enumerate(skipped)))
        self.end_step(buffers, rows)

    def apply_buckets(self, grads: dict[int, torch.Tensor | None], skipped: dict[int, set[int]]) -> None:
        """The optimizer's step on the entries of the buckets in `grads` (averaged gradients by bucket index)
        alone: the others have `.grad = None`, which every torch optimizer skips, so stepping the buckets one
        after the other is one step of an elementwise optimizer (`core.buckets.may_split`). Call with `lock`
        held."""
        if self.optimizer is None:
            return
        if self.journal is not None:
            self.journal.record("apply_buckets", {b: g if g is None else g.clone() for b, g in grads.items()}, skipped)
        if len(grads) < len(self.buckets) or self.keep_before:
            self.snapshot()  # a pull while the step's buckets are applied one by one sees the version before it
        for b, grad in grads.items():
            for i, (entry, tensor) in enumerate(zip(self.buckets[b].entries, self.entries[b])):
                tensor.grad = None if grad is None or i in skipped[b] else entry.view(grad)
        groups = self.optimizer.param_groups
        every = [g["params"] for g in groups]
        try:  # the step loops over these buckets' entries alone: a step per piece costs that piece
            for g in groups:
                g["params"] = [t for t in g["params"] if t.grad is not None]
            self.optimizer.step()
        finally:
            for g, params in zip(groups, every):
                g["params"] = params
        for b in grads:
            for tensor in self.entries[b]:
                tensor.grad = None
            self._fresh[b] = None

    def end_step(
        self, buffers: dict[str, torch.Tensor] | None, rows: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> None:
        """Close a step whose buckets are applied: the table rows' step, the averaged buffers, the next
        version. Call with `lock` held."""
        if self.journal is not None:
            self.journal.record("end_step", buffers, rows)
        self._closing()
        for name, (ids, row_grads) in (rows or {}).items():
            self.tables[name].apply(ids, row_grads)
        if buffers:
            with torch.no_grad():
                for name, value in buffers.items():
                    self.buffers[name].copy_(value)
        self.stats.version += 1
        self.stats.pushes_applied += 1
        fresh, self._fresh = self._fresh, [None] * len(self.buckets)
        self._published = None
        if self.buckets and all(f is not None for f in fresh):  # every piece was sent: they are the snapshot
            buffers = {n: b.to("cpu", copy=True) for n, b in self.buffers.items()}
            self._published = Snapshot(self.version, cast("list[torch.Tensor]", fresh), buffers)
        if self.journal is not None:
            self.journal.closed(self.stats)

    def taking(self, workers, partial=None) -> None:
        """The step that closes next took the pushes of `workers` (with `partial`, its norm's part: a held step):
        counted for a replica (`ps.replica.StepJournal`). Call with `lock` held."""
        if self.journal is not None:
            self.journal.closing(workers, partial)

    def skipped_step(self) -> None:
        """Close a step that changes nothing (skipped for a NaN/Inf, or by the workers' word). Call with `lock`
        held."""
        if self.journal is not None:
            self.journal.record("skipped_step")
        self._closing()
        if self.journal is not None:
            self.journal.closed(self.stats)

    def _closing(self) -> None:
        """Count the step that closes now; with `keep_before`, keep the snapshot it began at (published when its
        first bucket was applied)."""
        self.closed += 1
        if self.keep_before:
            self.before, self.before_options = self.snapshot(), self.began_options()
            self._began_options = None
        for table in self.tables.values():
            table.closing(self.keep_before)

    def piece(self, b: int) -> torch.Tensor:
        """A CPU copy of bucket `b`'s values (a piece's reply; once per step, shared by every worker and by
        the snapshot the step ends at). Call with `lock` held."""
        fresh = self._fresh[b]
        if fresh is None:
            fresh = self._fresh[b] = memory.cpu_copy(self.flats[b])
        return fresh

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of this shard's entries (by entry key), buffers and frozen parameters. Call with `lock` held."""
        out = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
        out.update(self.named_copies())
        return out

    def set_options(self, changes: dict[int, dict]) -> None:
        """Take a schedule's new group options ({group index: {option: value}}). Call with `lock` held."""
        if self.journal is not None:
            self.journal.record("set_options", changes)
        if self.keep_before and self._began_options is None:
            self._began_options = self.began_options()
        if self.optimizer is not None:
            apply_options(self.optimizer, changes)
        for table in self.tables.values():
            if table.group in changes and "lr" in changes[table.group]:
                table.set_lr(changes[table.group]["lr"])

    def began_options(self) -> list[dict]:
        """The optimizer groups' options the step in flight began with (with `keep_before`; else the current
        ones), [] without an optimizer. Call with `lock` held."""
        if self._began_options is not None:
            return self._began_options
        return [group_options(g) for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def optimizer_state(self) -> dict:
        """The optimizer's per-parameter state by entry key and its groups' options. Call with `lock` held."""
        if self.optimizer is None:
            return {"state": {}, "groups": []}
        return {
            "state": state_by_name(self.optimizer, self._keys),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    def load_optimizer_state(self, state: dict[str, dict], groups: list[dict]) -> None:
        """Replace the optimizer's state with `state` (by entry key) and its groups' options with `groups`.
        Call with `lock` held."""
        if self.optimizer is not None:
            load_by_name(self.optimizer, self._keys, state, groups)

    def named_copies(self) -> dict[str, torch.Tensor]:
        """CPU copies of the buffers and frozen parameters by name. Call with `lock` held."""
        out = {n: b.to("cpu", copy=True) for n, b in self.buffers.items()}
        out.update({n: t.clone() for n, t in self.frozen.items()})
        return out

    def layout(self) -> ShardLayout:
        """What the shard holds as plain data (its endpoint's). Call with `lock` held."""
        return ShardLayout(
            shard_id=self.shard_id,
            version=self.version,
            params=list(self.params),
            frozen=list(self.frozen),
            buffers=list(self.buffers),
            tables={n: layout for n, t in self.tables.items() if (layout := t.layout()) is not None},
            pieces=[e for b in self.buckets for e in b.entries if not e.whole],
            buckets=len(self.buckets),
            nbytes=sum(b.nbytes for b in self.buckets) + sum(b.nbytes for b in self.buffers.values()),
        )

    def restored(self) -> None:
        """Forget the published snapshot after a checkpoint was loaded into the shard. Call with `lock` held."""
        self._published = None
        self._fresh = [None] * len(self.buckets)
