"""The sync rule: a step applies the mean of the gradients of all W workers.

`SyncRule` averages each bucket of a step once all W workers have pushed and
sent their part of it (with the push, or as a piece of its own: the pipeline),
in worker order (one fused pass per bucket: `aggregate`, or
`dequantize_aggregate` for int8 pushes; see `wire`), so the result is the same
bit for bit whatever the arrival order; with an elementwise optimizer it applies
that bucket at once and answers its pieces while the next are on their way. A
bucket entry that no worker produced a gradient for is skipped by the optimizer;
one that some workers did is averaged over all W (zeros from the others), which
is what single-process training on the joint batch computes. Workers that ran
out of data (`trainer.join()`, told through `gradsync.membership.uneven_data`)
are not waited for: a step averages over the workers still active, which is
single-process training on the batches left when batches are of equal size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradsync.core.buckets import applied_early
from gradsync.core.clipping import Clipping
from gradsync.core.errors import GradientError, left_early_error
from gradsync.core.finite import first_nonfinite
from gradsync.core.futures import failed, resolved
from gradsync.metrics.timeline import PieceStamps
from gradsync.ps.averaging import blame, blame_rows, check_version, mean, mean_buffers, mean_rows, merged_options
from gradsync.ps.consistency import ConsistencyRule, answer
from gradsync.ps.dynamic_shard import step_end
from gradsync.ps.gradient_codecs import PLAIN, WireFormat
from gradsync.ps.messages import Agreement, Committed, Partial, Piece, Push, Snapshot
from gradsync.ps.piece_numbers import PieceNumbers
from gradsync.ps.shard import ShardState


class _Pending(NamedTuple):
    """One worker's validated push, waiting for the step in sync mode (its gradients are `_Part`s)."""

    worker: int
    buffers: dict
    rows: dict
    fut: torch.futures.Future
    options: dict  # a schedule's changed group options ({group: {option: value}}), applied before the step
    agree: Agreement | None  # hold the averaged gradient until the workers agree on its norm
    pieces: tuple | None  # per bucket, the seq of the piece that counts (`Push.pieces`); None: any


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
    reply: Committed  # what answered each worker's push of it: this server's part of its norm
    ended: tuple | None = None  # once applied or skipped: `Committed.ended`


class _Part(NamedTuple):
    """One worker's gradient of one bucket in a sync step: in a whole push (`fut` None), or a piece pushed
    on its own, answered with the bucket's values after the step."""

    payload: Any
    absent: tuple
    wire: WireFormat
    fut: torch.futures.Future | None
    seq: int = 0  # `Piece.seq`


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

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str, drop: bool = False):
        super().__init__(shard, num_workers, nonfinite)
        self._drop = drop  # worker_loss drop: a dead worker's step goes on without it (`worker_left`)
        self._early = applied_early(type(shard.optimizer), nonfinite, drop)
        self._gone: set[int] = set()  # workers that died (worker_loss drop): no later step waits for them
        self._deaths: dict[int, int] = {}  # worker_loss drop: worker -> its processes that died, as told here
        self._back: dict[int, int] = {}  # worker_loss drop: a dead worker's replacement -> the step it joins at
        self._pending: dict[int, _Pending] = {}
        self._parts: list[dict[int, _Part]] = [{} for _ in shard.buckets]  # this step's, by bucket and worker
        self._means: dict[int, tuple[torch.Tensor | None, set[int]]] = {}  # buckets averaged: (mean, skipped)
        self._options_set = False  # this step's group options are applied (before its first bucket)
        self._joined: set[int] = set()  # workers out of data this round (trainer.join())
        self._failure: Exception | None = None
        self._held: _Held | None = None  # a step waiting for the workers' word
        self._finishing: _Held | None = None  # the step applied on the first word, until every worker said it
        self.stamps = PieceStamps(len(shard.buckets))  # the step timeline's server events
        self._numbers = PieceNumbers(len(shard.buckets))  # which numbered pieces still count
        self._owed: set[int] = set()  # replaced workers whose push of the held step came from the dead process
        self._last_partial: Partial | None = None  # the norm's part of the last step closed, when it was held

    def _refused(self, worker: int, push: Push) -> torch.futures.Future | None:
        """A push of the step (`payloads` None: its buckets come as pieces) is refused when the step failed,
        a step is held, this worker already pushed it or has died. Call with the lock held."""
        held = self._held or self._finishing
        if held is not None and worker in self._owed:  # the replacement's push of it: the same bits
            self._owed.discard(worker)
            return resolved(held.reply)
        if (refused := self._closed(worker)) is not None:
            return refused
        if worker in self._pending:
            return self.shard.rejected(
                GradientError(f"worker {worker} committed twice at version {self.shard.version}")
            )
        return None

    def _take(
        self, worker: int, pulled_version: int, push: Push, checked: list | None, buffers: dict, wire
    ) -> tuple[torch.futures.Future, list[tuple]]:
        """Keep the push and its buckets' parts until the step is complete (refused when a piece of this
        worker already brought one of them). Call with the lock held."""
        answers = self._void(worker, push.seq) if checked is not None and push.seq else []
        try:
            for b in range(len(checked or ())):
                self._unsent(worker, b)
        except GradientError as e:
            return failed(e), answers
        for b, payload in enumerate(checked or ()):
            assert push.absent is not None  # sent with its payloads
            self._parts[b][worker] = _Part(payload, tuple(push.absent[b]), wire, None)
        fut: torch.futures.Future = torch.futures.Future()
        self._pending[worker] = _Pending(worker, buffers, push.rows, fut, push.options, push.agree, push.pieces)
        return fut, answers + self._progress()

    def _void(self, worker: int, seq: int) -> list[tuple]:
        """A whole push numbered `seq` voids this worker's pieces numbered below it: those here are answered
        None, those still on their way will be. Call with the lock held."""
        self._numbers.void_below(worker, seq)
        answers = []
        for parts in self._parts:
            part = parts.get(worker)
            if part is not None and part.fut is not None:
                del parts[worker]
                answers.append((part.fut, None, None))
        return answers

    def commit_piece(self, worker: int, pulled_version: int, piece: Piece, wire=PLAIN) -> torch.futures.Future:
        """One worker's gradient of a bucket (`piece`) in the step at `pulled_version`; resolves to the
        bucket's values after the step."""
        shard = self.shard
        with shard.lock:
            if (refused := self._closed(worker)) is not None:
                return refused
            b, absent = piece.bucket, tuple(piece.absent)
            if piece.seq and not self._numbers.take(worker, b, piece.seq):
                return resolved(None)  # superseded before it came
            try:
                check_version(shard, worker, pulled_version, exact=True)
                checked = shard.check_piece(worker, b, piece.payload, absent, wire)
                answers = self._supersede(worker, b, piece.seq)
            except GradientError as e:
                return shard.rejected(e)
            fut: torch.futures.Future = torch.futures.Future()
            self._parts[b][worker] = _Part(checked, absent, wire, fut, piece.seq)
            answers += self._progress()
        answer(answers)
        return fut

    def _supersede(self, worker: int, b: int, seq: int) -> list[tuple]:
        """Make room for this worker's piece of bucket `b` numbered `seq`: a numbered piece replaces the one
        it sent before (answered None; sent during a backward another one followed); an unnumbered one may
        come once per step. Call with the lock held."""
        if not seq:
            self._unsent(worker, b)
            return []
        old = self._parts[b].pop(worker, None)
        return [] if old is None or old.fut is None else [(old.fut, None, None)]

    def _closed(self, worker: int) -> torch.futures.Future | None:
        """The failed future that answers any push or piece now, if any: the step failed, one is held, or the
        worker has died (what it sent before is dropped). Call with the lock held."""
        if self._failure is not None:
            return failed(self._failure)
        self._returned()
        if worker in self._gone:
            return self.shard.rejected(
                GradientError(f"worker {worker} left the job: server {self.shard.shard_id} takes nothing more of it")
            )
        if self._held is not None:
            return self.shard.rejected(
                GradientError(
                    f"worker {worker} pushed at version {self.shard.version} while server {self.shard.shard_id} waits "
                    "for the workers to finish the held step (every worker must call finish before its next push)"
                )
            )
        return None

    def _unsent(self, worker: int, b: int) -> None:
        if worker in self._parts[b]:
            raise GradientError(
                f"worker {worker} sent bucket {self.shard.buckets[b].index} twice at version {self.shard.version}"
            )

    def finish(self, worker: int, version: int, coefficient: float | None) -> torch.futures.Future:
        """A worker's word on the held step: apply it with every gradient times `coefficient` (the workers'
        clipping coefficient; 1.0 for none), or skip it (None). The first word applies (or skips) it, and the
        next step's pushes may come; every pushing worker must give the same word, and each is answered with
        the version after the step (a `Committed`)."""
        shard = self.shard
        with shard.lock:
            held = self._held or self._finishing
            if held is None or version != held.version or worker not in held.workers or worker in held.finished:
                return failed(
                    GradientError(
                        f"worker {worker} finished a step at version {version}, but server {shard.shard_id} holds "
                        + (
                            "no step"
                            if held is None
                            else f"the step at version {held.version} pushed by workers "
                            f"{sorted(held.workers)}, finished by {sorted(held.finished)}"
                        )
                    )
                )
            said = set(held.finished.values())
            if said and said != {coefficient}:
                return failed(
                    GradientError(
                        f"worker {worker} finished the step at version {version} with {coefficient!r}, others with "
                        f"{said.pop()!r}: every worker must compute the same coefficient from the servers' partials"
                    )
                )
            if held is self._held:
                shard.taking(held.workers, held.reply.partial)
                shard.set_options(held.options)
                if coefficient is None:
                    shard.stats.steps_skipped += 1
                    shard.skipped_step()
                else:
                    scale = lambda g: g if g is None or coefficient == 1.0 else g * coefficient  # noqa: E731
                    shard.apply(
                        [scale(m) for m in held.means],
                        held.skipped,
                        held.buffers,
                        {n: (ids, scale(g)) for n, (ids, g) in held.rows.items()},
                    )
                held = held._replace(ended=step_end(shard.tables))
                self._held, self._finishing, self._last_partial = None, held, held.reply.partial
            held.finished[worker] = coefficient
            if len(held.finished) == len(held.workers):
                self._finishing = None
            return resolved(Committed(held.version + (coefficient is not None), ended=held.ended))

    def awaits_word(self, worker: int, version: int) -> bool:
        """Whether the held step at `version` waits for `worker`'s word: it pushed the step and has not said how to
        finish it (the step may be applied already, on another worker's word)."""
        with self.shard.lock:
            held = self._held or self._finishing
            return held is not None and held.version == version and worker in set(held.workers) - set(held.finished)

    def worker_joined(self, worker: int) -> None:
        """`worker` has no more data this round (it left its `trainer.join()` block): later steps average over
        the others, and a step that waited only for it is applied now. Once every worker has joined, all of
        them are active again (the next round: another epoch)."""
        with self.shard.lock:
            self._joined.add(worker)
            self._end_round()
            answers = self._progress()
        answer(answers)

    def _end_round(self) -> None:
        """Once every worker still in the job has joined, all of them are active again. Call with the lock held."""
        if self._joined >= set(range(self.num_workers)) - self._gone:
            self._joined = set()

    @property
    def dropped(self) -> frozenset[int]:
        """The workers the steps go on without now (worker_loss drop)."""
        with self.shard.lock:
            return frozenset(self._gone)

    def worker_restarted(self, worker: int) -> tuple[int, Snapshot | None, Snapshot | None, Partial | None, list[dict]]:
        """`worker` died and its replacement rejoins: what the dead process sent of the step in flight is
        forgotten (its parts of buckets already averaged stay in their mean), except a push of a held step, as
        which the replacement's push of it (the same bits) is answered. Returns `Rejoined`'s closed, begun,
        before, partial and options."""
        shard = self.shard
        with shard.lock:
            answers = self._forget(worker, RuntimeError(f"worker {worker} died; its replacement sends its part again"))
            self._numbers.forget(worker)
            shard.stats.workers_replaced[worker] = shard.stats.workers_replaced.get(worker, 0) + 1
            finishing = self._finishing
            found: tuple[int, Snapshot | None, Snapshot | None, Partial | None, list[dict]]
            if finishing is not None and worker in finishing.workers and worker not in finishing.finished:
                self._owed.add(worker)  # applied on the others' word: open for the replacement
                found = (shard.closed - 1, shard.before, None, None, shard.before_options)
            else:
                if self._held is not None and worker in self._held.workers:
                    self._owed.add(worker)
                found = (shard.closed, None, shard.before, self._last_partial, shard.began_options())
        answer(answers)
        return found

    def readmit(self, worker: int, number: int, step: int) -> tuple[bool, int]:
        """Take `worker`'s `number`-th replacement (worker_loss drop) into the steps from `step` on: (whether it is
        taken, the steps closed here). Taken unless this server closed `step` already (the replacement asks
        again, from a later step), or has not yet heard of the death it replaces (closed -1: it asks again; so
        too for a replacement that died since). The step it was taken at before is moved to `step` when that
        one has not got its part yet (another server had closed it)."""
        with self.shard.lock:
            if self._deaths.get(worker, 0) != number:  # not heard of yet, or that replacement died too
                return False, -1
            self._returned()
            closed = self.shard.closed
            if step < closed or (worker not in self._gone and step == closed):
                return step == closed, closed
            self._gone.add(worker)  # not waited for until `step` begins
            self._back[worker] = step
            self.shard.stats.workers_replaced[worker] = number
            self._returned()
            answers = self._progress()
        answer(answers)
        return True, closed

    def _returned(self) -> None:
        """Wait for each replacement taken at the step in flight (`readmit`) from now on. Call with the lock
        held."""
        for worker, step in list(self._back.items()):
            if self.shard.closed >= step:
                self._gone.discard(worker)
                del self._back[worker]

    def worker_left(self, worker: int, steps: int | None) -> None:
        """`worker` left the job after `steps` steps (None: it died). With worker_loss drop, the step that
        waits goes on without what it sent of that step, each bucket averaged over the workers left
        (`ShardStats.steps_without` records the step), and so do the later steps. Else no later step can have
        all W workers, so the step that waits (if any) and every later commit fail at once, naming it."""
        if self._drop:
            self._drop_worker(worker, died=steps is None)
            return
        assert steps is not None  # only an elastic job's worker goes without saying its steps (no sync job)
        with self.shard.lock:
            if self._failure is None:
                waiting = f"the sync step at version {self.shard.version} on server {self.shard.shard_id}"
                self._failure = left_early_error(worker, steps, waiting)
            answers = [(f, None, self._failure) for f in self._waiting()]
            self._reset()
        answer(answers)

    def _drop_worker(self, worker: int, died: bool) -> None:
        """The step in flight, and every later one, without `worker` (worker_loss drop), until a replacement
        taken after this death (`readmit`) joins."""
        with self.shard.lock:
            self._deaths[worker] = self._deaths.get(worker, 0) + died
            self._gone.add(worker)
            self._back.pop(worker, None)
            self._numbers.forget(worker)  # a replacement numbers its pieces from the start
            if self._joined:  # the others may all have joined: the round is over
                self._end_round()
            answers = self._forget(worker, GradientError(f"worker {worker} left the job; the step goes on without it"))
            self._means = {}  # averaged with its part: again without it (no bucket is applied before the step closes)
            answers += self._progress()
        answer(answers)

    def _forget(self, worker: int, error: Exception) -> list[tuple]:
        """Take what `worker` sent of the step in flight out of it (its head, its pieces); the answers (`error`) to
        give its calls not answered yet (a piece of a bucket applied was). Call with the lock held."""
        pending = self._pending.pop(worker, None)
        answers = [] if pending is None else [(pending.fut, None, error)]
        for parts in self._parts:
            part = parts.pop(worker, None)
            if part is not None and part.fut is not None and not part.fut.done():
                answers.append((part.fut, None, error))
        return answers

    def _waiting(self) -> list[torch.futures.Future]:
        """Every future of this step: the pushes', then the pieces'. Call with the lock held."""
        return [p.fut for p in self._pending.values()] + [
            p.fut for parts in self._parts for p in parts.values() if p.fut is not None
        ]

    def _reset(self) -> None:
        self._pending, self._parts, self._means = {}, [{} for _ in self.shard.buckets], {}
        self._options_set = False

    def _progress(self) -> list[tuple]:
        """Average (and, when it may, apply) every bucket whose parts are all in, once every active worker
        has pushed; close the step when every bucket is averaged. Returns the answers to give outside the
        lock: (future, value, error). Call with the lock held."""
        self._returned()
        active = self.num_workers - len(self._joined | self._gone)
        if not self._pending or len(self._pending) < active:
            return []
        shard, workers = self.shard, sorted(self._pending)
        agree = self._pending[workers[0]].agree
        early = self._early and agree is None
        answers: list[tuple] = []
        for b, parts in enumerate(self._parts):
            if b in self._means or not all(self._counts(parts, w, b) for w in workers):
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

    def _counts(self, parts: dict[int, _Part], worker: int, b: int) -> bool:
        """Whether `worker`'s part of bucket `b` is in: the piece its push names, when it names one."""
        named = self._pending[worker].pieces
        return worker in parts and (named is None or parts[worker].seq == named[b])

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
        if self._gone - self._joined:  # this step's index among those closed, and the dead workers it lacks
            shard.stats.steps_without[shard.closed] = sorted(self._gone)
        rows = mean_rows(shard, pending, len(pending))
        error = blame_rows(rows, [(p.worker, p.rows) for p in pending])
        if error is not None and not (agree is not None and agree.skip_nonfinite):
            return self._dropped(error)
        means = [self._means[b][0] for b in range(len(shard.buckets))]
        skipped = [self._means[b][1] for b in range(len(shard.buckets))]
        buffers = mean_buffers([p.buffers for p in pending])
        pieces = [(b, p.fut) for b, parts in enumerate(self._parts) for p in parts.values() if p.fut is not None]
        answers: list[tuple]
        if agree is not None:
            options = merged_options([(w, self._pending[w].options) for w in workers])  # checked by the workers
            value = Committed(
                shard.version,
                partial=Partial(
                    shard.version,
                    Clipping(norm_type=agree.norm_type).partial(
                        [m for m in means if m is not None] + [g for _, g in rows.values()]
                    ),
                ),
            )
            self._held = _Held(shard.version, means, skipped, buffers, rows, options, set(workers), {}, value)
            answers = [
                (f, None, GradientError("a held step's buckets come back with its finish, not as pieces"))
                for _, f in pieces
            ]
        else:
            if (error := self._set_options(workers)) is not None:
                return self._dropped(error, nonfinite=False)
            self._last_partial = None
            shard.taking(workers)
            if early:
                shard.end_step(buffers, rows)
            else:
                shard.apply(means, skipped, buffers, rows)
                self.stamps.applied(range(len(shard.buckets)))
            value = Committed(shard.version, ended=step_end(shard.tables))
            if early:  # the step's pieces are answered; pieces left by a worker that pushed no step are void
                answers = [
                    (p.fut, None, None)
                    for parts in self._parts
                    for w, p in parts.items()
                    if p.fut is not None and w not in self._pending
                ]
            else:
                answers = [(f, shard.piece(b), None) for b, f in pieces]
        self._reset()
        return answers + [(p.fut, value, None) for p in pending]

    def _dropped(self, error: GradientError, nonfinite: bool = True) -> list[tuple]:
        """The step cannot be applied (a NaN/Inf, options the workers disagree on): with nonfinite='raise'
        it fails, and every later push with it; with 'skip' nothing of it is applied and every push and piece
        is answered as if it had not come. Call with the lock held."""
        shard = self.shard
        answers: list[tuple]
        if self.nonfinite == "raise":
            self._failure = error
            answers = [(f, None, error) for f in self._waiting()]
        else:
            shard.stats.steps_skipped += nonfinite
            shard.taking(self._pending)
            shard.skipped_step()
            self._last_partial = None
            answers = [(p.fut, Committed(shard.version), None) for p in self._pending.values()]
            answers += [
                (p.fut, shard.piece(b), None)
                for b, parts in enumerate(self._parts)
                for p in parts.values()
                if p.fut is not None
            ]
        self._reset()
        return answers
