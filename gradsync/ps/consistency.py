"""Consistency rules: when a server applies the gradients its workers push.

`SyncRule` waits for all W workers of a step, then averages their gradients in
worker order (one fused pass per bucket: `aggregate`, or `dequantize_aggregate`
for int8 pushes; see `wire`), so the result is the same bit for bit whatever
the arrival order. A bucket entry that no worker produced a gradient for is
skipped by the optimizer; one that some workers did is averaged over all W
(zeros from the others), which is what single-process training on the joint
batch computes. Workers that ran out of data (`trainer.join()`, told through
`gradsync.membership.uneven_data`) are not waited for: a step averages over the workers still
active, which is single-process training on the batches left when batches are
of equal size. `AsyncRule` applies each worker's gradient as it arrives and
tracks staleness; `SSPRule` does too (scaled by 1/W) but holds a worker's reply
while it is more than `staleness` steps ahead of the slowest worker. Each returns
a `torch.futures.Future` that resolves to the
shard's version after the step, or fails with the reason.

NaN/Inf is found with one cheap reduction per bucket (`core.finite`); only
when it trips are the parameter and the worker searched for.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from gradsync.core.clipping import Clipping
from gradsync.core.errors import GradientError, left_early_error, nonfinite_error
from gradsync.core.finite import first_nonfinite
from gradsync.core.optimizer_spec import same_value
from gradsync.core.tables import merge_rows
from gradsync.cuda_ops import aggregate
from gradsync.ps.shard import ShardState, Snapshot
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


def _validated(shard: ShardState, worker: int, pulled_version: int, grads: list, absent: list, buffers: dict,
               wire, exact: bool, rows: dict):
    """Check one push; returns (payloads, buffers). Call with the lock held.

    Raises:
        GradientError: counted as a rejected push; nothing is changed.
    """
    try:
        _check_version(shard, worker, pulled_version, exact)
        checked = shard.check_gradients(worker, grads, absent, wire)
        buffers = shard.check_buffers(worker, buffers)
        _check_rows(shard, worker, rows, exact)
    except GradientError:
        shard.stats.pushes_rejected += 1
        raise
    shard.stats.workers_seen.add(worker)
    return checked, buffers


def _check_rows(shard: ShardState, worker: int, rows: dict, exact: bool) -> None:
    """Validate one push's row gradients: {table: (pulled version, unique local ids, gradients)}."""
    if not isinstance(rows, dict):
        raise GradientError(f"worker {worker}: row gradients must be a dict by table name, got {type(rows).__name__}")
    for name, push in rows.items():
        table = shard.tables.get(name)
        if table is None:
            raise GradientError(f"worker {worker} pushed rows of table {name!r}, which server {shard.shard_id} "
                                f"does not hold (it holds {sorted(shard.tables)})")
        if not isinstance(push, tuple) or len(push) != 3:
            raise GradientError(f"worker {worker}: rows of table {name!r} must be (version, ids, gradients)")
        _check_version(shard, worker, push[0], exact)
        table.check_push(worker, push[1], push[2])


def _row_staleness(shard: ShardState, rows: dict) -> None:
    for name, (version, _, _) in rows.items():
        stats = shard.tables[name].stats
        stats.max_staleness = max(stats.max_staleness, shard.version - version)


def _mean_rows(shard: ShardState, pending: list, workers: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per table any worker pushed rows of: the unique rows and their gradients summed over the workers
    (in worker order) and divided by the `workers` of the step (a row a worker did not look up counts zero)."""
    out = {}
    for name in shard.tables:
        pushes = [(p.rows[name][1], p.rows[name][2]) for p in pending if name in p.rows]
        if pushes:
            out[name] = merge_rows(pushes, 1.0 / workers)
    return out


def _blame_rows(means: dict, pushes: list[tuple[int, dict]]) -> GradientError | None:
    """The error naming the first table whose mean row gradient is non-finite and a worker that sent one
    (pushes: (worker, its rows) per worker)."""
    names = list(means)
    bad = first_nonfinite([means[n][1] for n in names])
    if bad is None:
        return None
    name = names[bad]
    culprit = next((w for w, rows in pushes if name in rows and first_nonfinite([rows[name][2]]) is not None),
                   "none alone (the average of finite gradients overflowed)")
    return nonfinite_error(name, culprit)


def _skipped(shard: ShardState, pushes: list[tuple[list, list]]) -> list[set[int]]:
    """Per bucket, the entries no worker sent a gradient for (pushes: (payloads, absent) per worker)."""
    out = []
    for b, bucket in enumerate(shard.buckets):
        every = set(range(len(bucket.entries)))
        for payloads, absent in pushes:
            every &= every if payloads[b] is None else set(absent[b])
        out.append(every)
    return out


def _blame(shard: ShardState, means: list, per_worker: list[tuple[int, list, object]]) -> GradientError | None:
    """The error naming the first parameter whose mean gradient is non-finite and the worker that sent
    NaN/Inf for it (None when every mean is finite: the cheap check was a false alarm)."""
    for b, mean in enumerate(means):
        entries = shard.buckets[b].entries
        bad = None if mean is None else first_nonfinite([e.view(mean) for e in entries])
        if bad is None:
            continue
        for worker, payloads, wire in per_worker:
            if payloads[b] is not None:
                decoded = wire.decode(payloads[b], torch.float32)
                if first_nonfinite([entries[bad].view(decoded)]) is not None:
                    return nonfinite_error(entries[bad].name, worker)
        return nonfinite_error(entries[bad].name, "none alone (the average of finite gradients overflowed)")
    return None


def _mean(shard: ShardState, b: int, pushes: list[tuple[object, object]], workers: int) -> torch.Tensor | None:
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


class _Push(NamedTuple):
    """One worker's validated push, waiting for the step in sync mode."""

    worker: int
    payloads: list
    absent: list
    buffers: dict
    rows: dict
    wire: object
    fut: torch.futures.Future
    options: dict  # a schedule's changed group options ({group: {option: value}}), applied before the step
    agree: Agreement | None  # hold the averaged gradient until the workers agree on its norm


class Agreement(NamedTuple):
    """A sync push asks its server to hold the averaged gradient and answer with its part of the norm
    (`Partial`), for the workers to agree on the step's total norm (clipping) or finiteness (a GradScaler)
    before any server applies (`SyncRule.finish`)."""

    norm_type: float
    skip_nonfinite: bool  # a NaN/Inf skips the step (GradScaler) instead of being the job's error


class Partial(NamedTuple):
    """A server's part of a held step's norm: sum of |g|^p of its averaged gradient (max |g| for p = inf)."""

    version: int
    value: float


class _Held(NamedTuple):
    """A sync step averaged and held, at `version`, until every worker has said how to finish it."""

    version: int
    means: list
    skipped: list
    buffers: dict
    rows: dict
    options: dict
    workers: set  # the workers that pushed it
    finished: dict  # worker -> the coefficient it asked for (None: skip)


class SyncRule:
    """Apply the mean of the gradients of all W workers, less those that joined, once per step."""

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str):
        self.shard = shard
        self.num_workers = num_workers
        self.nonfinite = nonfinite
        self._pending: dict[int, _Push] = {}
        self._joined: set[int] = set()  # workers out of data this round (trainer.join())
        self._failure: Exception | None = None
        self._held: _Held | None = None  # a step waiting for the workers' word
        self._finishing: _Held | None = None  # the step applied on the first word, until every worker said it

    def commit(self, worker: int, pulled_version: int, grads: list, absent: list, buffers: dict,
               wire=PLAIN, rows: dict | None = None, options: dict | None = None,
               agree: Agreement | None = None) -> torch.futures.Future:
        """One worker's push of the step; resolves to the version after it, or with `agree` to this server's
        `Partial` of the held step's norm (then `finish` applies it)."""
        shard = self.shard
        rows = {} if rows is None else rows
        with shard.lock:
            if self._failure is not None:
                return _done(error=self._failure)
            if self._held is not None:
                shard.stats.pushes_rejected += 1
                return _done(error=GradientError(
                    f"worker {worker} pushed at version {shard.version} while server {shard.shard_id} waits for "
                    "the workers to finish the held step (every worker must call finish before its next push)"))
            if worker in self._pending:
                shard.stats.pushes_rejected += 1
                return _done(error=GradientError(f"worker {worker} committed twice at version {shard.version}"))
            try:
                checked, buffers = _validated(shard, worker, pulled_version, grads, absent, buffers, wire,
                                              exact=True, rows=rows)
            except GradientError as e:
                return _done(error=e)
            fut: torch.futures.Future = torch.futures.Future()
            self._pending[worker] = _Push(worker, checked, absent, buffers, rows, wire, fut, options or {}, agree)
            done = self._complete()
        _resolve(*done)
        return fut

    def finish(self, worker: int, version: int, coefficient: float | None) -> torch.futures.Future:
        """A worker's word on the held step: apply it with every gradient times `coefficient` (the workers'
        clipping coefficient; 1.0 for none), or skip it (None). The first word applies (or skips) it, and the
        next step's pushes may come; every pushing worker must give the same word, and each is answered with
        the version after the step."""
        shard = self.shard
        with shard.lock:
            held = self._held or self._finishing
            if held is None or version != held.version or worker not in held.workers or worker in held.finished:
                return _done(error=GradientError(
                    f"worker {worker} finished a step at version {version}, but server {shard.shard_id} holds "
                    + ("no step" if held is None else f"the step at version {held.version} pushed by workers "
                       f"{sorted(held.workers)}, finished by {sorted(held.finished)}")))
            said = set(held.finished.values())
            if said and said != {coefficient}:
                return _done(error=GradientError(
                    f"worker {worker} finished the step at version {version} with {coefficient!r}, others with "
                    f"{said.pop()!r}: every worker must compute the same coefficient from the servers' partials"))
            if held is self._held:
                shard.set_options(held.options)
                if coefficient is None:
                    shard.stats.steps_skipped += 1
                else:
                    scale = lambda g: g if g is None or coefficient == 1.0 else g * coefficient  # noqa: E731
                    shard.apply([scale(m) for m in held.means], held.skipped, held.buffers,
                                {n: (ids, scale(g)) for n, (ids, g) in held.rows.items()})
                self._held, self._finishing = None, held
            held.finished[worker] = coefficient
            if len(held.finished) == len(held.workers):
                self._finishing = None
            return _done(held.version + (coefficient is not None))

    def worker_joined(self, worker: int) -> None:
        """`worker` has no more data this round (it left its `trainer.join()` block): later steps average over
        the others, and a step that waited only for it is applied now. Once every worker has joined, all of
        them are active again (the next round: another epoch)."""
        with self.shard.lock:
            self._joined.add(worker)
            if len(self._joined) == self.num_workers:
                self._joined = set()
            done = self._complete()
        _resolve(*done)

    def _complete(self) -> tuple[list[_Push], GradientError | None, int | Partial]:
        """When every active worker has pushed: apply (or hold) the step; returns (the pushes to answer, the
        error that fails them, the version or `Partial` to answer with). Call with the lock held."""
        active = self.num_workers - len(self._joined)
        if not self._pending or len(self._pending) < active:
            return [], None, self.shard.version
        pending = [self._pending[w] for w in sorted(self._pending)]
        self._pending = {}
        error = self._step(pending)
        if isinstance(error, Partial):
            return pending, None, error
        if error is not None and self.nonfinite == "raise":
            self._failure = error
        else:
            error = None  # dropped under nonfinite='skip': the pushes are answered with the version
        return pending, error, self.shard.version

    def worker_left(self, worker: int, steps: int) -> None:
        """`worker` left the job after `steps` steps: no later step can have all W workers, so the step that
        waits (if any) and every later commit fail at once, naming it."""
        with self.shard.lock:
            if self._failure is None:
                waiting = f"the sync step at version {self.shard.version} on server {self.shard.shard_id}"
                self._failure = left_early_error(worker, steps, waiting)
            pending, self._pending = list(self._pending.values()), {}
        for push in pending:
            push.fut.set_exception(self._failure)

    def _step(self, pending: list[_Push]) -> GradientError | Partial | None:
        """Average and apply one step; returns the non-finite error instead of applying (nothing changes), or,
        when the pushes ask to agree, hold it and return this server's `Partial` of its norm."""
        shard = self.shard
        try:
            options = merged_options([(p.worker, p.options) for p in pending])
        except GradientError as e:
            return e
        means = [_mean(shard, b, [(p.payloads[b], p.wire) for p in pending], len(pending))
                 for b in range(len(shard.buckets))]
        rows = _mean_rows(shard, pending, len(pending))
        agree = pending[0].agree
        error = None
        if first_nonfinite([m for m in means if m is not None]) is not None:
            error = _blame(shard, means, [(p.worker, p.payloads, p.wire) for p in pending])
        error = error or _blame_rows(rows, [(p.worker, p.rows) for p in pending])
        if error is not None and not (agree is not None and agree.skip_nonfinite):
            shard.stats.steps_skipped += self.nonfinite == "skip"
            return error
        skipped = _skipped(shard, [(p.payloads, p.absent) for p in pending])
        buffers = mean_buffers([p.buffers for p in pending])
        if agree is not None:
            self._held = _Held(shard.version, means, skipped, buffers, rows, options, {p.worker for p in pending}, {})
            parts = [m for m in means if m is not None] + [g for _, g in rows.values()]
            return Partial(shard.version, Clipping(norm_type=agree.norm_type).partial(parts))
        shard.set_options(options)
        shard.apply(means, skipped, buffers, rows)
        return None


def _resolve(pending: list[_Push], error: GradientError | None, version: int | Partial) -> None:
    """Answer a sync step's pushes (outside the lock): the error, or the version after the step (a `Partial`
    of a held step)."""
    for push in pending:
        if error is not None:
            push.fut.set_exception(error)
        else:
            push.fut.set_result(version)


class AsyncRule:
    """Apply each worker's gradient as it arrives, under the shard lock."""

    scale = 1.0  # of each push's gradients

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str):
        self.shard = shard
        self.nonfinite = nonfinite

    def commit(self, worker: int, pulled_version: int, grads: list, absent: list, buffers: dict,
               wire=PLAIN, rows: dict | None = None, options: dict | None = None,
               agree: Agreement | None = None) -> torch.futures.Future:
        """Apply one worker's push now, with its schedule's changed `options` (a worker clips its own push:
        `agree` must be None)."""
        shard = self.shard
        rows = {} if rows is None else rows
        with shard.lock:
            try:
                if agree is not None:
                    raise GradientError(f"worker {worker} asked server {shard.shard_id} to hold its push for a "
                                        "joint norm, which only sync steps have: async workers clip their own push")
                checked, buffers = _validated(shard, worker, pulled_version, grads, absent, buffers, wire,
                                              exact=False, rows=rows)
            except GradientError as e:
                return _done(error=e)
            decoded = [None if g is None else _scaled(wire.decode(g, b.dtype), self.scale)
                       for g, b in zip(checked, shard.buckets)]
            merged = {name: (ids, _scaled(grads, self.scale)) for name, (_, ids, grads) in rows.items()}
            error = None
            if first_nonfinite([g for g in decoded if g is not None]) is not None:
                error = _blame(shard, decoded, [(worker, checked, wire)])
            error = error or _blame_rows(merged, [(worker, rows)])
            if error is not None:
                shard.stats.pushes_rejected += 1
                return _done(error=error) if self.nonfinite == "raise" else _done(shard.version)
            stale = shard.version - pulled_version
            shard.stats.max_staleness = max(shard.stats.max_staleness, stale)
            shard.stats.staleness_histogram[stale] = shard.stats.staleness_histogram.get(stale, 0) + 1
            _row_staleness(shard, rows)
            shard.set_options(options or {})
            shard.apply(decoded, _skipped(shard, [(checked, absent)]), buffers, merged)
            shard.stats.pushes_by_worker[worker] = shard.stats.pushes_by_worker.get(worker, 0) + 1
            return _done(shard.version)

    def worker_left(self, worker: int, steps: int) -> None:
        """Nothing to do: an async step needs no other worker."""

    def worker_joined(self, worker: int) -> None:
        """Nothing to do: an async step needs no other worker."""


class SSPRule(AsyncRule):
    """Stale synchronous parallel: each push is applied as it arrives, scaled by 1/W (W pushes make one
    step of the mean), but a worker's reply (and so its next step) waits until the slowest worker is at
    most `staleness` steps behind it, and resolves to the `Snapshot` it goes on from. staleness 0 is lock
    step: with plain SGD, the parameters of sync training. Workers that joined (`trainer.join()`) are not
    waited for, and the pushes applied after the server learns of a join are scaled by 1 / the workers still
    active, as sync steps average over them."""

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str, staleness: int):
        super().__init__(shard, num_workers, nonfinite)
        self.num_workers = num_workers
        self.scale = 1.0 / num_workers
        self.staleness = staleness
        self.clock = {w: 0 for w in range(num_workers)}  # pushes applied per worker still in the job
        self._joined: set[int] = set()  # workers out of data this round
        self._waiting: list[tuple[int, torch.futures.Future]] = []  # (slowest clock it needs, reply)

    def commit(self, worker: int, pulled_version: int, grads: list, absent: list, buffers: dict,
               wire=PLAIN, rows: dict | None = None, options: dict | None = None,
               agree: Agreement | None = None) -> torch.futures.Future:
        applied = super().commit(worker, pulled_version, grads, absent, buffers, wire, rows, options,
                                 agree)  # done at once
        try:
            applied.wait()
        except Exception:
            return applied
        shard = self.shard
        fut: torch.futures.Future = torch.futures.Future()
        with shard.lock:
            lead = self.clock.get(worker, 0) - min(self.clock.values(), default=0)
            shard.stats.max_lead = max(shard.stats.max_lead, lead)
            if worker in self.clock:
                self.clock[worker] += 1
                self._waiting.append((self.clock[worker] - self.staleness, fut))
            else:  # a worker that was reported gone: its push counts, it waits for no one
                self._waiting.append((0, fut))
            ready, snapshot = self._release()
        for waiting in ready:
            waiting.set_result(snapshot)
        return fut

    def _release(self) -> tuple[list[torch.futures.Future], Snapshot]:
        """The replies whose worker may go on now, and the snapshot they go on from: taken here, under the
        lock, because a released worker's next push is applied at once (call with the lock held)."""
        slowest = min(self.clock.values(), default=float("inf"))
        ready = [f for need, f in self._waiting if need <= slowest]
        self._waiting = [(need, f) for need, f in self._waiting if need > slowest]
        return ready, self.shard.snapshot()

    def worker_left(self, worker: int, steps: int) -> None:
        """The slowest clock no longer counts `worker`: those who waited for it go on."""
        with self.shard.lock:
            self.clock.pop(worker, None)
            ready, snapshot = self._release()
        for waiting in ready:
            waiting.set_result(snapshot)

    def worker_joined(self, worker: int) -> None:
        """`worker` has no more data this round: as if it left, and the others' pushes weigh 1 / those active;
        once every worker has joined, all start the next round level, at 1 / W."""
        with self.shard.lock:
            self._joined.add(worker)
            if len(self._joined) == self.num_workers:
                self._joined = set()
                self.clock = {w: 0 for w in range(self.num_workers)}
            else:
                self.clock.pop(worker, None)
            self.scale = 1.0 / (self.num_workers - len(self._joined))
            ready, snapshot = self._release()
        for waiting in ready:
            waiting.set_result(snapshot)


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
                said = lambda w, c: f"to {c[key]!r}" if key in c else "not at all"  # noqa: E731
                raise GradientError(
                    f"in the same step worker {first} changed {key!r} of optimizer group {g} {said(first, mine)} and "
                    f"worker {worker} {said(worker, other)}: every worker must drive the schedule alike (the same "
                    "scheduler, stepped once per step on every worker)"
                )
    return changes


def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    return grad if scale == 1.0 else grad * scale


def make_rule(mode: str, shard: ShardState, num_workers: int, nonfinite: str, staleness: int = 0):
    """The consistency rule of `mode` ('sync', 'async', 'ssp') for `shard`."""
    if mode == "ssp":
        return SSPRule(shard, num_workers, nonfinite, staleness)
    return {"sync": SyncRule, "async": AsyncRule}[mode](shard, num_workers, nonfinite)
