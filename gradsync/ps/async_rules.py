"""The async rules: each worker's push is applied as it arrives.

`AsyncRule` applies each worker's gradient as it arrives and tracks staleness, and ends a step of the
server's dynamic tables after each push it applies (`ps.dynamic_shard`, `alone`);
`SSPRule` does too (scaled by 1/W) but holds a worker's reply while it is more
than `staleness` steps ahead of the slowest worker. With worker_loss wait, a dead worker's replacement goes on
after the pushes of it each server applied (`worker_restarted`); under ssp its clock stays, so the others wait
for it as for the dead one.
"""

from __future__ import annotations

import torch

from gradsync.core.errors import GradientError
from gradsync.core.finite import first_nonfinite
from gradsync.core.futures import failed, resolved
from gradsync.ps.averaging import blame, blame_rows, row_staleness, scaled, skipped_entries
from gradsync.ps.consistency import ConsistencyRule, answer
from gradsync.ps.gradient_codecs import PLAIN
from gradsync.ps.messages import Committed, Push
from gradsync.ps.shard import ShardState


class AsyncRule(ConsistencyRule):
    """Apply each worker's gradient as it arrives, under the shard lock."""

    scale = 1.0  # of each push's gradients

    def __init__(self, shard: ShardState, num_workers: int, nonfinite: str):
        super().__init__(shard, num_workers, nonfinite)
        self.taken: dict[int, int] = {}  # pushes applied per worker since the shard was built

    def _refused(self, worker: int, push: Push) -> torch.futures.Future | None:
        """A push that asks to be held for a joint norm: a worker clips its own push."""
        if push.agree is not None:
            return failed(
                GradientError(
                    f"worker {worker} asked server {self.shard.shard_id} to hold its push for "
                    "a joint norm, which only sync steps have: async workers clip their own push"
                )
            )
        return None

    def _take(
        self, worker: int, pulled_version: int, push: Push, checked: list | None, buffers: dict, wire
    ) -> tuple[torch.futures.Future, list[tuple]]:
        """Apply one worker's push now, with its schedule's changed options. Call with the lock held."""
        # whole: a head waits in `staging` for its pieces, and comes here with them
        assert checked is not None and push.absent is not None
        shard, rows = self.shard, push.rows
        decoded = [
            None if g is None else scaled(wire.decode(g, b.dtype), self.scale) for g, b in zip(checked, shard.buckets)
        ]
        merged = {
            name: shard.tables[name].current(r.version, r.ids, scaled(r.grads, self.scale)) for name, r in rows.items()
        }
        error = None
        if first_nonfinite([g for g in decoded if g is not None]) is not None:
            error = next(
                (
                    e
                    for b, g in enumerate(decoded)
                    if g is not None and (e := blame(shard, b, g, [(worker, checked[b], wire)]))
                ),
                None,
            )
        error = error or blame_rows(merged, [(worker, rows)])
        if error is not None:
            rejected = shard.rejected(error)
            return (rejected if self.nonfinite == "raise" else resolved(Committed(shard.version))), []
        stale = shard.version - pulled_version
        shard.stats.max_staleness = max(shard.stats.max_staleness, stale)
        shard.stats.staleness_histogram[stale] = shard.stats.staleness_histogram.get(stale, 0) + 1
        row_staleness(shard, rows)
        shard.stats.pushes_by_worker[worker] = shard.stats.pushes_by_worker.get(worker, 0) + 1  # (a replica's too)
        self.taken[worker] = self.taken.get(worker, 0) + 1
        shard.taking((worker,))
        shard.set_options(push.options)
        shard.apply(decoded, skipped_entries(shard, [(checked, push.absent)]), buffers, merged)
        for table in shard.tables.values():  # a dynamic table's own step per push applied (`ps.dynamic_shard`)
            table.pushed_alone()
        return resolved(Committed(shard.version)), []

    def worker_restarted(self, worker: int) -> tuple[int, None, None, None, list[dict]]:
        """`worker` died and its replacement takes its place (worker_loss wait): it goes on after the pushes of
        it applied here, from the current values. Returns `Rejoined`'s closed, begun, before, partial and
        options."""
        shard = self.shard
        with shard.lock:
            shard.stats.workers_replaced[worker] = shard.stats.workers_replaced.get(worker, 0) + 1
            return self.taken.get(worker, 0), None, None, None, []

    def worker_left(self, worker: int, steps: int | None) -> None:
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
        answer(answers)
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

    def worker_left(self, worker: int, steps: int | None) -> None:
        """The slowest clock no longer counts `worker`: those who waited for it go on."""
        with self.shard.lock:
            self.clock.pop(worker, None)
            answers = self._release()
        answer(answers)

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
        answer(answers)
