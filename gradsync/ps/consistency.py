"""Consistency rules: when a server applies the gradients its workers commit.

`SyncRule` waits for all W workers of a step, averages their gradients in
worker order (one fused pass per bucket: `aggregate`, or `dequantize_aggregate`
for int8 pushes; see `wire`), so the result is the same
bit for bit whatever the arrival order), applies the optimizer once and then
releases every waiting worker. `AsyncRule` applies each worker's gradient as
it arrives and tracks staleness. Both return a `torch.futures.Future` that
resolves to the shard's new version, or fails with the reason.
"""
from __future__ import annotations

import torch

from gradsync.cuda_ops import aggregate
from gradsync.ps.buckets import Bucket
from gradsync.ps.shard import GradientError, ShardState
from gradsync.ps.wire import PLAIN


def _done(value=None, error: Exception | None = None) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
    return fut


def _check_version(shard: ShardState, worker: int, pulled_version: int, exact: bool) -> None:
    if pulled_version > shard.version or (exact and pulled_version != shard.version):
        raise GradientError(
            f"worker {worker} computed its gradient at version {pulled_version} but server "
            f"{shard.shard_id} is at version {shard.version}"
            + (" (a version from the future)" if pulled_version > shard.version else " (stale in sync mode)")
        )


def _validated(shard: ShardState, worker: int, pulled_version: int, grads: list, buffers: dict, wire, exact: bool):
    """Check one push; returns (gradients, buffers, first non-finite parameter or None). Call with the lock held.

    Raises:
        GradientError: counted as a rejected push; nothing is changed.
    """
    try:
        _check_version(shard, worker, pulled_version, exact)
        checked = shard.check_gradients(worker, grads, wire)
        buffers = shard.check_buffers(worker, buffers)
    except GradientError:
        shard.stats.pushes_rejected += 1
        raise
    shard.stats.workers_seen.add(worker)
    return checked, buffers, shard.nonfinite_parameter(checked, wire)


def _mean(bucket: Bucket, pushes: list[tuple[object, object]]) -> torch.Tensor:
    """The mean of W workers' (payload, wire) for one bucket, in one fused pass when they share a format."""
    wires = {wire.name for _, wire in pushes}
    if len(wires) == 1:
        return pushes[0][1].mean([payload for payload, _ in pushes], bucket.dtype)
    decoded = [wire.decode(payload, torch.float32) for payload, wire in pushes]
    return aggregate(decoded, 1.0 / len(decoded), bucket.dtype)


def _nonfinite_error(shard: ShardState, worker: int, name: str) -> GradientError:
    return GradientError(
        f"non-finite gradient (NaN or Inf) for parameter {name!r} from worker {worker}: "
        "lower the learning rate or check the loss; pass nonfinite='skip' to gradsync.init "
        "(or GRADSYNC_NONFINITE=skip) to drop such steps instead"
    )


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


class SyncRule:
    """Apply the mean of all W workers' gradients once per step."""

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str):
        self.shard = shard
        self.num_workers = num_workers
        self.nonfinite = nonfinite
        self._pending: dict[int, tuple[list, dict, torch.futures.Future, object]] = {}
        self._failure: Exception | None = None
        self._skip_step = False

    def commit(self, worker: int, pulled_version: int, grads: list, buffers: dict, wire=PLAIN) -> torch.futures.Future:
        shard = self.shard
        with shard.lock:
            if self._failure is not None:
                return _done(error=self._failure)
            if worker in self._pending:
                shard.stats.pushes_rejected += 1
                return _done(error=GradientError(f"worker {worker} committed twice at version {shard.version}"))
            try:
                checked, buffers, name = _validated(shard, worker, pulled_version, grads, buffers, wire, exact=True)
            except GradientError as e:
                return _done(error=e)
            if name is not None and self.nonfinite == "raise":
                self._failure = _nonfinite_error(shard, worker, name)
                for _, _, fut, _ in self._pending.values():
                    fut.set_exception(self._failure)
                self._pending.clear()
                return _done(error=self._failure)
            fut: torch.futures.Future = torch.futures.Future()
            self._pending[worker] = (checked, buffers, fut, wire)
            self._skip_step = self._skip_step or name is not None
            if len(self._pending) < self.num_workers:
                return fut
            pending = [self._pending[w] for w in sorted(self._pending)]
            self._pending = {}
            if self._skip_step:  # nonfinite='skip': a NaN/Inf from any worker drops the whole step
                self._skip_step = False
                shard.stats.steps_skipped += 1
            else:
                mean = [_mean(b, [(g[i], w) for g, _, _, w in pending]) for i, b in enumerate(shard.buckets)]
                shard.apply(mean, mean_buffers([b for _, b, _, _ in pending]))
            version = shard.version
        for _, _, waiting, _ in pending:
            waiting.set_result(version)
        return fut


class AsyncRule:
    """Apply each worker's gradient as it arrives, under the shard lock."""

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str):
        self.shard = shard
        self.nonfinite = nonfinite

    def commit(self, worker: int, pulled_version: int, grads: list, buffers: dict, wire=PLAIN) -> torch.futures.Future:
        shard = self.shard
        with shard.lock:
            try:
                checked, buffers, name = _validated(shard, worker, pulled_version, grads, buffers, wire, exact=False)
            except GradientError as e:
                return _done(error=e)
            if name is not None:
                shard.stats.pushes_rejected += 1
                if self.nonfinite == "raise":
                    return _done(error=_nonfinite_error(shard, worker, name))
                return _done(shard.version)
            shard.stats.max_staleness = max(shard.stats.max_staleness, shard.version - pulled_version)
            shard.apply([wire.decode(g, b.dtype) for g, b in zip(checked, shard.buckets)], buffers)
            return _done(shard.version)


RULES = {"sync": SyncRule, "async": AsyncRule}
