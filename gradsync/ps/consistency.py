"""Consistency rules: when a server applies the gradients its workers push.

`SyncRule` averages each bucket of a step once all W workers have pushed and
sent their part of it (with the push, or as a piece of its own: the pipeline),
in worker order (one fused pass per bucket: `aggregate`, or
`dequantize_aggregate` for int8 pushes; see `wire`), so the result is the same
bit for bit whatever the arrival order; with an elementwise optimizer it applies
that bucket at once and answers its pieces while the next are on their way. A bucket entry that no worker produced a gradient for is
skipped by the optimizer; one that some workers did is averaged over all W
(zeros from the others), which is what single-process training on the joint
batch computes. Workers that ran out of data (`trainer.join()`, told through
`gradsync.membership.uneven_data`) are not waited for: a step averages over the workers still
active, which is single-process training on the batches left when batches are
of equal size. `AsyncRule` applies each worker's gradient as it arrives and
tracks staleness; `SSPRule` does too (scaled by 1/W) but holds a worker's reply
while it is more than `staleness` steps ahead of the slowest worker. Each is a
`ConsistencyRule`, whose `commit` returns a `torch.futures.Future` that resolves
to a `Committed` (`ps.messages`: the shard's version after the step, and what
the reply carries beyond it), or fails with the reason.

NaN/Inf is found with one cheap reduction per bucket (`core.finite`); only
when it trips are the parameter and the worker searched for.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from gradsync.core.buckets import may_split
from gradsync.core.clipping import Clipping
from gradsync.core.errors import GradientError, left_early_error
from gradsync.core.finite import first_nonfinite
from gradsync.core.futures import failed, resolved
from gradsync.ps.averaging import (blame, blame_rows, check_version, mean, mean_buffers, mean_rows, merged_options,
                                   row_staleness, scaled, skipped_entries, validated)
from gradsync.ps.messages import Agreement, Committed, Partial, Piece, Push
from gradsync.ps.shard import ShardState
from gradsync.core.timeline import PieceStamps
from gradsync.ps.wire import PLAIN


class _Pending(NamedTuple):
    """One worker's validated push, waiting for the step in sync mode (its gradients are `_Part`s)."""

    worker: int
    buffers: dict
    rows: dict
    fut: torch.futures.Future
    options: dict  # a schedule's changed group options ({group: {option: value}}), applied before the step
    agree: Agreement | None  # hold the averaged gradient until the workers agree on its norm


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


class _Part(NamedTuple):
    """One worker's gradient of one bucket in a sync step: in a whole push (`fut` None), or a piece pushed
    on its own, answered with the bucket's values after the step."""

    payload: object
    absent: tuple
    wire: object
    fut: torch.futures.Future | None


class ConsistencyRule(ABC):
    """When a server applies its workers' pushes. `commit` checks a push (a bad one changes nothing and fails
    its future, naming the problem) and hands it to the rule; every rule's future resolves to a `Committed`."""

    exact = False  # a push must be computed at the shard's current version

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str):
        self.shard = shard
        self.num_workers = num_workers
        self.nonfinite = nonfinite

    def commit(self, worker: int, pulled_version: int, push: Push, wire=PLAIN) -> torch.futures.Future:
        """One worker's push at the version it pulled, its payloads in `wire`'s format; resolves to a
        `Committed`, or fails with the reason."""
        shard = self.shard
        with shard.lock:
            if (refused := self._refused(worker, push)) is not None:
                return refused
            try:
                checked, buffers = validated(shard, worker, pulled_version, push, wire, exact=self.exact)
            except GradientError as e:
                return failed(e)
            fut, answers = self._take(worker, pulled_version, push, checked, buffers, wire)
        _answer(answers)
        return fut

    def _refused(self, worker: int, push: Push) -> torch.futures.Future | None:
        """The failed future that answers this push before it is checked, if any. Call with the lock held."""
        return None

    @abstractmethod
    def _take(self, worker: int, pulled_version: int, push: Push, checked: list | None, buffers: dict, wire
              ) -> tuple[torch.futures.Future, list[tuple]]:
        """A checked push (`checked`: its payloads on the shard's device, `buffers` its buffers): the future
        that answers it and the answers to give outside the lock. Call with the lock held."""

    @abstractmethod
    def worker_left(self, worker: int, steps: int | None) -> None:
        """`worker` left the job after `steps` steps."""

    @abstractmethod
    def worker_joined(self, worker: int) -> None:
        """`worker` ran out of data this round (`trainer.join()`)."""


class SyncRule(ConsistencyRule):
    """Apply the mean of the gradients of all W workers, less those that joined, once per step.

    A step's gradients come bucket by bucket: with the push (`commit`) or as pieces on their own
    (`commit_piece`: the pipeline, where the push is a header that carries no gradient). A bucket is averaged
    once every worker of the step has pushed and sent its part, and, when it may be applied early, applied
    and answered at once, while the next buckets are still on their way: with an elementwise optimizer
    (`may_split`: stepping buckets apart is one step), nonfinite='raise' and no agreement. Otherwise every
    bucket waits for the whole step (a step skipped for a NaN/Inf changes nothing; a held step waits for the
    workers' word on its norm)."""

    exact = True

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str):
        super().__init__(shard, num_workers, nonfinite)
        self._early = nonfinite == "raise" and may_split(type(shard.optimizer))
        self._pending: dict[int, _Pending] = {}
        self._parts: list[dict[int, _Part]] = [{} for _ in shard.buckets]  # this step's, by bucket and worker
        self._means: dict[int, tuple[torch.Tensor | None, set[int]]] = {}  # buckets averaged: (mean, skipped)
        self._options_set = False  # this step's group options are applied (before its first bucket)
        self._joined: set[int] = set()  # workers out of data this round (trainer.join())
        self._failure: Exception | None = None
        self._held: _Held | None = None  # a step waiting for the workers' word
        self._finishing: _Held | None = None  # the step applied on the first word, until every worker said it
        self.stamps = PieceStamps(len(shard.buckets))  # the step timeline's server events

    def _refused(self, worker: int, push: Push) -> torch.futures.Future | None:
        """A push of the step (`payloads` None: its buckets come as pieces) is refused when the step failed,
        a step is held, or this worker already pushed it. Call with the lock held."""
        if (refused := self._closed(worker)) is not None:
            return refused
        if worker in self._pending:
            return self.shard.rejected(GradientError(f"worker {worker} committed twice at version "
                                                     f"{self.shard.version}"))
        return None

    def _take(self, worker: int, pulled_version: int, push: Push, checked: list | None, buffers: dict, wire
              ) -> tuple[torch.futures.Future, list[tuple]]:
        """Keep the push and its buckets' parts until the step is complete (refused when a piece of this
        worker already brought one of them). Call with the lock held."""
        try:
            for b in range(len(checked or ())):
                self._unsent(worker, b)
        except GradientError as e:
            return failed(e), []
        for b, payload in enumerate(checked or ()):
            self._parts[b][worker] = _Part(payload, tuple(push.absent[b]), wire, None)
        fut: torch.futures.Future = torch.futures.Future()
        self._pending[worker] = _Pending(worker, buffers, push.rows, fut, push.options, push.agree)
        return fut, self._progress()

    def commit_piece(self, worker: int, pulled_version: int, piece: Piece, wire=PLAIN) -> torch.futures.Future:
        """One worker's gradient of a bucket (`piece`) in the step at `pulled_version`; resolves to the
        bucket's values after the step."""
        shard = self.shard
        with shard.lock:
            if (refused := self._closed(worker)) is not None:
                return refused
            b, absent = piece.bucket, tuple(piece.absent)
            try:
                check_version(shard, worker, pulled_version, exact=True)
                checked = shard.check_piece(worker, b, piece.payload, absent, wire)
                self._unsent(worker, b)
            except GradientError as e:
                return shard.rejected(e)
            fut: torch.futures.Future = torch.futures.Future()
            self._parts[b][worker] = _Part(checked, absent, wire, fut)
            answers = self._progress()
        _answer(answers)
        return fut

    def _closed(self, worker: int) -> torch.futures.Future | None:
        """The failed future that answers any push or piece now, if any: the step failed, or one is held.
        Call with the lock held."""
        if self._failure is not None:
            return failed(self._failure)
        if self._held is not None:
            return self.shard.rejected(GradientError(
                f"worker {worker} pushed at version {self.shard.version} while server {self.shard.shard_id} waits "
                "for the workers to finish the held step (every worker must call finish before its next push)"))
        return None

    def _unsent(self, worker: int, b: int) -> None:
        if worker in self._parts[b]:
            raise GradientError(f"worker {worker} sent bucket {self.shard.buckets[b].index} twice at version "
                                f"{self.shard.version}")

    def finish(self, worker: int, version: int, coefficient: float | None) -> torch.futures.Future:
        """A worker's word on the held step: apply it with every gradient times `coefficient` (the workers'
        clipping coefficient; 1.0 for none), or skip it (None). The first word applies (or skips) it, and the
        next step's pushes may come; every pushing worker must give the same word, and each is answered with
        the version after the step (a `Committed`)."""
        shard = self.shard
        with shard.lock:
            held = self._held or self._finishing
            if held is None or version != held.version or worker not in held.workers or worker in held.finished:
                return failed(GradientError(
                    f"worker {worker} finished a step at version {version}, but server {shard.shard_id} holds "
                    + ("no step" if held is None else f"the step at version {held.version} pushed by workers "
                       f"{sorted(held.workers)}, finished by {sorted(held.finished)}")))
            said = set(held.finished.values())
            if said and said != {coefficient}:
                return failed(GradientError(
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
            return resolved(Committed(held.version + (coefficient is not None)))

    def worker_joined(self, worker: int) -> None:
        """`worker` has no more data this round (it left its `trainer.join()` block): later steps average over
        the others, and a step that waited only for it is applied now. Once every worker has joined, all of
        them are active again (the next round: another epoch)."""
        with self.shard.lock:
            self._joined.add(worker)
            if len(self._joined) == self.num_workers:
                self._joined = set()
            answers = self._progress()
        _answer(answers)

    def worker_left(self, worker: int, steps: int) -> None:
        """`worker` left the job after `steps` steps: no later step can have all W workers, so the step that
        waits (if any) and every later commit fail at once, naming it."""
        with self.shard.lock:
            if self._failure is None:
                waiting = f"the sync step at version {self.shard.version} on server {self.shard.shard_id}"
                self._failure = left_early_error(worker, steps, waiting)
            answers = [(f, None, self._failure) for f in self._waiting()]
            self._reset()
        _answer(answers)

    def _waiting(self) -> list[torch.futures.Future]:
        """Every future of this step: the pushes', then the pieces'. Call with the lock held."""
        return [p.fut for p in self._pending.values()] + [p.fut for parts in self._parts for p in parts.values()
                                                          if p.fut is not None]

    def _reset(self) -> None:
        self._pending, self._parts, self._means = {}, [{} for _ in self.shard.buckets], {}
        self._options_set = False

    def _progress(self) -> list[tuple]:
        """Average (and, when it may, apply) every bucket whose parts are all in, once every active worker
        has pushed; close the step when every bucket is averaged. Returns the answers to give outside the
        lock: (future, value, error). Call with the lock held."""
        active = self.num_workers - len(self._joined)
        if not self._pending or len(self._pending) < active:
            return []
        shard, workers = self.shard, sorted(self._pending)
        agree = self._pending[workers[0]].agree
        early = self._early and agree is None
        answers = []
        for b, parts in enumerate(self._parts):
            if b in self._means or any(w not in parts for w in workers):
                continue
            mine = [parts[w] for w in workers]
            self.stamps.arrived(b, shard.version)
            avg = mean(shard, b, [(p.payload, p.wire) for p in mine], len(workers))
            if avg is not None and first_nonfinite([avg]) is not None:
                error = blame(shard, b, avg, [(w, p.payload, p.wire) for w, p in zip(workers, mine)])
                if error is not None and not (agree is not None and agree.skip_nonfinite):
                    return answers + self._dropped(error)
            every = set(range(len(shard.buckets[b].entries)))
            self._means[b] = (avg, {i for i in every if all(p.payload is None or i in p.absent for p in mine)})
            if early:
                if (error := self._set_options(workers)) is not None:
                    return answers + self._dropped(error, nonfinite=False)
                shard.apply_buckets({b: avg}, {b: self._means[b][1]})
                self.stamps.applied([b])
                value = shard.piece(b)
                answers += [(p.fut, value, None) for p in mine if p.fut is not None]
        if len(self._means) < len(shard.buckets):
            return answers
        return answers + self._close(workers, agree, early)

    def _set_options(self, workers: list[int]) -> GradientError | None:
        """Apply the step's group options once, before its first bucket. Call with the lock held."""
        if not self._options_set:
            try:
                self.shard.set_options(merged_options([(w, self._pending[w].options) for w in workers]))
            except GradientError as e:
                return e
            self._options_set = True
        return None

    def _close(self, workers: list[int], agree: Agreement | None, early: bool) -> list[tuple]:
        """Every bucket is averaged: the rows and buffers too, then apply the rest (or hold the step). Call
        with the lock held."""
        shard = self.shard
        pending = [self._pending[w] for w in workers]
        rows = mean_rows(shard, pending, len(pending))
        error = blame_rows(rows, [(p.worker, p.rows) for p in pending])
        if error is not None and not (agree is not None and agree.skip_nonfinite):
            return self._dropped(error)
        means = [self._means[b][0] for b in range(len(shard.buckets))]
        skipped = [self._means[b][1] for b in range(len(shard.buckets))]
        buffers = mean_buffers([p.buffers for p in pending])
        pieces = [(b, p.fut) for b, parts in enumerate(self._parts) for p in parts.values() if p.fut is not None]
        if agree is not None:
            options = merged_options([(w, self._pending[w].options) for w in workers])  # checked by the workers
            self._held = _Held(shard.version, means, skipped, buffers, rows, options, set(workers), {})
            value = Committed(shard.version, partial=Partial(shard.version, Clipping(norm_type=agree.norm_type).partial(
                [m for m in means if m is not None] + [g for _, g in rows.values()])))
            answers = [(f, None, GradientError("a held step's buckets come back with its finish, not as pieces"))
                       for _, f in pieces]
        else:
            if (error := self._set_options(workers)) is not None:
                return self._dropped(error, nonfinite=False)
            if early:
                shard.end_step(buffers, rows)
            else:
                shard.apply(means, skipped, buffers, rows)
                self.stamps.applied(range(len(shard.buckets)))
            value = Committed(shard.version)
            answers = [] if early else [(f, shard.piece(b), None) for b, f in pieces]
        self._reset()
        return answers + [(p.fut, value, None) for p in pending]

    def _dropped(self, error: GradientError, nonfinite: bool = True) -> list[tuple]:
        """The step cannot be applied (a NaN/Inf, options the workers disagree on): with nonfinite='raise'
        it fails, and every later push with it; with 'skip' nothing of it is applied and every push and piece
        is answered as if it had not come. Call with the lock held."""
        shard = self.shard
        if self.nonfinite == "raise":
            self._failure = error
            answers = [(f, None, error) for f in self._waiting()]
        else:
            shard.stats.steps_skipped += nonfinite
            answers = [(p.fut, Committed(shard.version), None) for p in self._pending.values()]
            answers += [(p.fut, shard.piece(b), None) for b, parts in enumerate(self._parts) for p in parts.values()
                        if p.fut is not None]
        self._reset()
        return answers


def _answer(answers: list[tuple]) -> None:
    """Resolve futures outside the lock: (future, value, error) each."""
    for fut, value, error in answers:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


class AsyncRule(ConsistencyRule):
    """Apply each worker's gradient as it arrives, under the shard lock."""

    scale = 1.0  # of each push's gradients

    def _refused(self, worker: int, push: Push) -> torch.futures.Future | None:
        """A push that asks to be held for a joint norm: a worker clips its own push."""
        if push.agree is not None:
            return failed(GradientError(f"worker {worker} asked server {self.shard.shard_id} to hold its push for "
                                        "a joint norm, which only sync steps have: async workers clip their own push"))
        return None

    def _take(self, worker: int, pulled_version: int, push: Push, checked: list, buffers: dict, wire
              ) -> tuple[torch.futures.Future, list[tuple]]:
        """Apply one worker's push now, with its schedule's changed options. Call with the lock held."""
        shard, rows = self.shard, push.rows
        decoded = [None if g is None else scaled(wire.decode(g, b.dtype), self.scale)
                   for g, b in zip(checked, shard.buckets)]
        merged = {name: (r.ids, scaled(r.grads, self.scale)) for name, r in rows.items()}
        error = None
        if first_nonfinite([g for g in decoded if g is not None]) is not None:
            error = next((e for b, g in enumerate(decoded)
                          if g is not None and (e := blame(shard, b, g, [(worker, checked[b], wire)]))), None)
        error = error or blame_rows(merged, [(worker, rows)])
        if error is not None:
            rejected = shard.rejected(error)
            return (rejected if self.nonfinite == "raise" else resolved(Committed(shard.version))), []
        stale = shard.version - pulled_version
        shard.stats.max_staleness = max(shard.stats.max_staleness, stale)
        shard.stats.staleness_histogram[stale] = shard.stats.staleness_histogram.get(stale, 0) + 1
        row_staleness(shard, rows)
        shard.set_options(push.options)
        shard.apply(decoded, skipped_entries(shard, [(checked, push.absent)]), buffers, merged)
        shard.stats.pushes_by_worker[worker] = shard.stats.pushes_by_worker.get(worker, 0) + 1
        return resolved(Committed(shard.version)), []

    def worker_left(self, worker: int, steps: int) -> None:
        """Nothing to do: an async step needs no other worker."""

    def worker_joined(self, worker: int) -> None:
        """Nothing to do: an async step needs no other worker."""


class SSPRule(AsyncRule):
    """Stale synchronous parallel: each push is applied as it arrives, scaled by 1/W (W pushes make one
    step of the mean), but a worker's reply (and so its next step) waits until the slowest worker is at
    most `staleness` steps behind it, and resolves with the `Snapshot` it goes on from. staleness 0 is lock
    step: with plain SGD, the parameters of sync training. Workers that joined (`trainer.join()`) are not
    waited for, and the pushes applied after the server learns of a join are scaled by 1 / the workers still
    active, as sync steps average over them."""

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str, staleness: int):
        super().__init__(shard, num_workers, nonfinite)
        self.scale = 1.0 / num_workers
        self.staleness = staleness
        self.clock = {w: 0 for w in range(num_workers)}  # pushes applied per worker still in the job
        self._joined: set[int] = set()  # workers out of data this round
        self._waiting: list[tuple[int, torch.futures.Future]] = []  # (slowest clock it needs, reply)

    def commit(self, worker: int, pulled_version: int, push: Push, wire=PLAIN) -> torch.futures.Future:
        """Apply the push now (`AsyncRule`); its future resolves once the worker may go on."""
        applied = super().commit(worker, pulled_version, push, wire)  # done at once
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
            answers = self._release()
        _answer(answers)
        return fut

    def _release(self) -> list[tuple]:
        """The answers to the replies whose worker may go on now: a `Committed` with the snapshot they go on
        from, taken here, under the lock, because a released worker's next push is applied at once. Call with
        the lock held."""
        slowest = min(self.clock.values(), default=float("inf"))
        ready = [f for need, f in self._waiting if need <= slowest]
        self._waiting = [(need, f) for need, f in self._waiting if need > slowest]
        snapshot = self.shard.snapshot()
        released = Committed(snapshot.version, snapshot=snapshot)
        return [(f, released, None) for f in ready]

    def worker_left(self, worker: int, steps: int) -> None:
        """The slowest clock no longer counts `worker`: those who waited for it go on."""
        with self.shard.lock:
            self.clock.pop(worker, None)
            answers = self._release()
        _answer(answers)

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
            answers = self._release()
        _answer(answers)


def make_rule(mode: str, shard: ShardState, num_workers: int, nonfinite: str, staleness: int = 0
              ) -> ConsistencyRule:
    """The consistency rule of `mode` ('sync', 'async', 'ssp') for `shard`."""
    if mode == "ssp":
        return SSPRule(shard, num_workers, nonfinite, staleness)
    return {"sync": SyncRule, "async": AsyncRule}[mode](shard, num_workers, nonfinite)
