"""Checking and averaging the pushes of a step, shared by the consistency rules (`ps.consistency`).

A push is validated before it is kept (version, bucket payloads, buffers, table rows), so a bad one
changes nothing; a step's bucket means are the sum of its workers' payloads in worker order, scaled once;
a non-finite mean is blamed on the parameter and the worker that sent NaN/Inf for it.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from gradsync.core.errors import GradientError, nonfinite_error
from gradsync.core.finite import first_nonfinite
from gradsync.core.optimizer_spec import same_value
from gradsync.cuda_ops import aggregate
from gradsync.ps.gradient_codecs import WireFormat
from gradsync.ps.messages import PipelineHead, Push, RowGrads
from gradsync.ps.shard import ShardState
from gradsync.tables.placement import merge_rows


def check_version(shard: ShardState, worker: int, pulled_version: int, exact: bool) -> None:
    if pulled_version > shard.version or (exact and pulled_version != shard.version):
        raise GradientError(
            f"worker {worker} computed its gradient at version {pulled_version} but server "
            f"{shard.shard_id} is at version {shard.version}"
            + (" (a version from the future)" if pulled_version > shard.version else " (stale in sync mode)")
        )


def validated(shard: ShardState, worker: int, pulled_version: int, push: Push, wire, exact: bool):
    """Check one push (`payloads` None: a sync push whose buckets come as pieces); returns (payloads or None,
    buffers), on the shard's device. Call with the lock held.

    Raises:
        GradientError: counted as a rejected push; nothing is changed.
    """
    try:
        check_version(shard, worker, pulled_version, exact)
        checked = (
            None
            if isinstance(push, PipelineHead)
            # a push that is not a head carries its payloads and absence lists
            else shard.check_gradients(worker, cast(list, push.payloads), cast(list, push.absent), wire)
        )
        buffers = shard.check_buffers(worker, push.buffers)
        check_rows(shard, worker, push.rows, exact)
    except GradientError:
        shard.stats.pushes_rejected += 1
        raise
    shard.stats.workers_seen.add(worker)
    return checked, buffers


def check_rows(shard: ShardState, worker: int, rows: dict, exact: bool) -> None:
    """Validate one push's row gradients: {table: `RowGrads`}."""
    if not isinstance(rows, dict):
        raise GradientError(f"worker {worker}: row gradients must be a dict by table name, got {type(rows).__name__}")
    for name, push in rows.items():
        table = shard.tables.get(name)
        if table is None:
            raise GradientError(
                f"worker {worker} pushed rows of table {name!r}, which server {shard.shard_id} "
                f"does not hold (it holds {sorted(shard.tables)})"
            )
        if not isinstance(push, RowGrads):
            raise GradientError(
                f"worker {worker}: rows of table {name!r} are a {type(push).__name__}, expected "
                "gradsync.ps.messages.RowGrads(version, ids, grads)"
            )
        check_version(shard, worker, push.version, exact)
        table.check_push(worker, push.ids, push.grads)


def row_staleness(shard: ShardState, rows: dict[str, RowGrads]) -> None:
    for name, push in rows.items():
        stats = shard.tables[name].stats
        stats.max_staleness = max(stats.max_staleness, shard.version - push.version)


def mean_rows(shard: ShardState, pending: list, workers: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per table any worker pushed rows of: the unique rows and their gradients summed over the workers
    (in worker order) and divided by the `workers` of the step (a row a worker did not look up counts zero)."""
    out = {}
    for name in shard.tables:
        pushes = [(p.rows[name].ids, p.rows[name].grads) for p in pending if name in p.rows]
        if pushes:
            out[name] = merge_rows(pushes, 1.0 / workers)
    return out


def blame_rows(means: dict, pushes: list[tuple[int, dict[str, RowGrads]]]) -> GradientError | None:
    """The error naming the first table whose mean row gradient is non-finite and a worker that sent one
    (pushes: (worker, its rows) per worker)."""
    names = list(means)
    bad = first_nonfinite([means[n][1] for n in names])
    if bad is None:
        return None
    name = names[bad]
    culprit = next(
        (w for w, rows in pushes if name in rows and first_nonfinite([rows[name].grads]) is not None),
        "none alone (the average of finite gradients overflowed)",
    )
    return nonfinite_error(name, culprit)


def skipped_entries(shard: ShardState, pushes: list[tuple[list, list]]) -> list[set[int]]:
    """Per bucket, the entries no worker sent a gradient for (pushes: (payloads, absent) per worker)."""
    out = []
    for b, bucket in enumerate(shard.buckets):
        every = set(range(len(bucket.entries)))
        for payloads, absent in pushes:
            every &= every if payloads[b] is None else set(absent[b])
        out.append(every)
    return out


def blame(
    shard: ShardState, b: int, mean: torch.Tensor, per_worker: list[tuple[int, Any, WireFormat]]
) -> GradientError | None:
    """The error naming the first parameter of bucket `b` whose mean gradient is non-finite and the worker
    that sent NaN/Inf for it (per_worker: (worker, payload, wire)); None when every entry's mean is finite
    (the cheap check was a false alarm)."""
    entries = shard.buckets[b].entries
    bad = first_nonfinite([e.view(mean) for e in entries])
    if bad is None:
        return None
    for worker, payload, wire in per_worker:
        decoded = None if payload is None else wire.decode(payload, torch.float32)
        if decoded is not None and first_nonfinite([entries[bad].view(decoded)]) is not None:
            return nonfinite_error(entries[bad].name, worker)
    return nonfinite_error(entries[bad].name, "none alone (the average of finite gradients overflowed)")


def mean(shard: ShardState, b: int, pushes: list[tuple[Any, WireFormat]], workers: int) -> torch.Tensor | None:
    """Sum of the workers' (payload, wire) for bucket b divided by `workers`; None when no worker sent one."""
    pushes = [(p, w) for p, w in pushes if p is not None]
    if not pushes:
        return None
    dtype = shard.buckets[b].dtype
    if len({wire.name for _, wire in pushes}) == 1:
        return pushes[0][1].mean([p for p, _ in pushes], dtype, 1.0 / workers)
    return aggregate([wire.decode(p, torch.float32) for p, wire in pushes], 1.0 / workers, dtype)


def mean_buffers(per_worker: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Floating buffers averaged over workers (in order); integer ones taken from the first."""
    per_worker = [b for b in per_worker if b]
    if not per_worker:
        return {}
    out = {}
    for name, first in per_worker[0].items():
        if first.is_floating_point():
            out[name] = aggregate([b[name] for b in per_worker], 1.0 / len(per_worker))
        else:
            out[name] = first
    return out


def merged_options(pushes: list[tuple[int, dict]]) -> dict[int, dict]:
    """The group options a sync step's pushes ((worker, changes) in worker order) changed: the workers agreed
    before, so they agree after only if each changed the same options to the same values.

    Raises:
        GradientError: naming an option two workers changed differently (or one changed and one did not).
    """
    first, changes = pushes[0]
    for worker, theirs in pushes[1:]:
        for g in sorted(set(changes) | set(theirs)):
            mine, other = changes.get(g, {}), theirs.get(g, {})
            for key in sorted(set(mine) | set(other)):
                if key in mine and key in other and same_value(mine[key], other[key]):
                    continue
                said = lambda w, c: f"to {c[key]!r}" if key in c else "not at all"  # noqa: E731, B023 (called in this iteration)
                raise GradientError(
                    f"in the same step worker {first} changed {key!r} of optimizer group {g} {said(first, mine)} and "
                    f"worker {worker} {said(worker, other)}: every worker must drive the schedule alike (the same "
                    "scheduler, stepped once per step on every worker)"
                )
    return changes


def scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    return grad if scale == 1.0 else grad * scale
