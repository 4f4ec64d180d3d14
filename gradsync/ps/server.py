"""The parameter server: registration barrier, pulls and pushes, with no transport inside.

One `ParameterServer` lives in each server process; a transport
(`gradsync.transport.rpc`, `gradsync.transport.grpc.job_calls`) turns its messages into
calls on it. The server waits until all W workers have registered the same
model, builds its `ShardState` from worker 0's values, then serves pulls (the
published snapshot of the current version) and pushes (one worker's bucket
gradients, absent entries and buffers at the version it pulled, in the job's
wire format), handed to the consistency rule.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
import threading
import traceback
from collections.abc import Callable
from typing import cast

import torch

from gradsync.core import malloc, settings
from gradsync.core.buckets import ModelSpec
from gradsync.core.errors import GradientError, Refusal, failed_answering, model_mismatch_error, server_failure_error
from gradsync.core.futures import failed, resolved
from gradsync.ps import reshard, shard_file
from gradsync.ps.async_rules import AsyncRule, SSPRule
from gradsync.ps.consistency import ConsistencyRule
from gradsync.ps.dynamic_shard import DynamicShard, respond
from gradsync.ps.gradient_codecs import make_wire
from gradsync.ps.layout import ShardLayout
from gradsync.ps.lookup_replay import LookupReplay
from gradsync.ps.messages import (
    Committed,
    DynamicSetup,
    Lookups,
    Partial,
    Piece,
    PipelineHead,
    Push,
    Readmitted,
    Rejoined,
    Setup,
    Snapshot,
    TableCall,
    TableSetup,
)
from gradsync.ps.named_grads import push_named
from gradsync.ps.replica import Replays, ReplicaLink, ShardCopy, StepJournal, StepRecord
from gradsync.ps.shard import ShardState
from gradsync.ps.staging import Staging
from gradsync.ps.sync_rule import SyncRule
from gradsync.ps.table_shard import TableShard


class ParameterServer:
    """State of one server process; methods are thread-safe."""

    def __init__(
        self,
        shard_id: int,
        num_workers: int,
        mode: str,
        nonfinite: str,
        compression: str = "none",
        device: str = "cpu",
        staleness: int = 0,
        resume_from: tuple[str, int, str | None] | None = None,
        on_failure: Callable[[str], None] | None = None,
        worker_loss: str = "fail",
        replicated: bool = False,
    ):
        self.shard_id = shard_id
        self.replicated = replicated  # replicas 1: the shard is kept on two servers (`ps.replica`)
        self.link: ReplicaLink | None = None  # replicas: where its closed steps go (none while it is a replica)
        self._layout: Setup | None = None  # replicas: its setup without values, for a replica built anew (`copy_for`)
        self._replays: Replays | None = None  # a replica's: the records it takes, replayed in order
        self.replaces_workers = worker_loss == "wait"  # a dead worker's replacement may rejoin (`rejoin`)
        # its dynamic tables' lookups of a sync step again
        self._replay = LookupReplay() if self.replaces_workers and mode == "sync" else None
        self.worker_loss = worker_loss
        self.resume_from = resume_from  # (checkpoint folder, the number of servers that wrote it, its full base)
        self._last_full: str | None = None  # the folder of the last full checkpoint written (deltas go onto it)
        self.on_failure = on_failure  # told this server's own failure (`fail`), before any worker is
        self.failed = False  # whether this server has failed (`fail`): it stops
        self._failing = threading.Lock()
        self.staleness = staleness
        self.device = _usable_device(device)
        self.wire = make_wire(compression)
        self.num_workers = num_workers
        self.mode = mode
        self.nonfinite = nonfinite
        self.shard: ShardState | None = None
        self.rule: ConsistencyRule | None = None
        self.staging: Staging | None = None  # async and ssp: pieces that left during a worker's backward
        self._lock = threading.Lock()
        self._registrations: dict[int, tuple[ModelSpec, torch.futures.Future]] = {}
        self._reference: ModelSpec | None = None  # worker 0's model, which a worker that joins must match
        self._refusal: Exception | None = None  # why registrations fail: a worker left before all registered
        self._setup: Setup | None = None
        self._loads = 0  # the number of the last worker's module load taken (`load_values`)
        self.ready = threading.Event()

    def register(self, worker: int, spec: ModelSpec, setup: Setup | None) -> torch.futures.Future:
        """Barrier of all W workers; worker 0 brings `setup` (buckets, values, optimizer).

        The returned future resolves to this shard's frozen parameters (worker 0's values, which every
        worker then uses), and fails on every worker when any worker's model differs from worker 0's.
        In async mode a worker may register later, joining the running job (`_admit`).
        """
        with self._lock:
            if self._refusal is not None:
                return failed(self._refusal)
            if self.ready.is_set() and worker not in self._registrations:
                return self._admit(worker, spec)
            if self.ready.is_set() or worker in self._registrations:
                return failed(RuntimeError(f"worker {worker} registered twice with server {self.shard_id}"))
            fut: torch.futures.Future = torch.futures.Future()
            self._registrations[worker] = (spec, fut)
            if setup is not None:
                self._setup = setup
            if len(self._registrations) < self.num_workers:
                return fut
            registrations = dict(self._registrations)
            error = self._mismatch(registrations)
            if error is None:
                assert self._setup is not None  # `_mismatch` refuses a round without worker 0's setup
                try:
                    self.shard = self._build(self._setup)
                except (MemoryError, ValueError, OSError) as e:  # a table that does not fit, bad rows, a bad checkpoint
                    error = e
            if error is None:
                shard = self._shard()
                self.rule = make_rule(
                    self.mode, shard, self.num_workers, self.nonfinite, self.staleness, self.worker_loss == "drop"
                )
                if not self.pipelined:
                    self.staging = Staging(len(shard.buckets), self._commit)
                if self.replicated:
                    self._layout = _without_values(cast(Setup, self._setup))
                self._setup = None
                self._reference = registrations[0][0]
                self.ready.set()
        for _, waiting in registrations.values():
            if error is None:
                waiting.set_result(self._shard().frozen)
            else:
                waiting.set_exception(error)
        return fut

    def _admit(self, worker: int, spec: ModelSpec) -> torch.futures.Future:
        """A worker that joins the running job: in async mode, with worker 0's model. Call with `_lock` held."""
        if self.mode != "async":
            return failed(
                RuntimeError(
                    f"worker {worker} cannot join: server {self.shard_id} runs a {self.mode} job, whose steps count "
                    f"its {self.num_workers} workers; workers join async jobs (--mode async)"
                )
            )
        assert self._reference is not None  # set with `ready`
        if (diff := self._reference.difference(spec)) is not None:
            return failed(model_mismatch_error(worker, diff))
        fut = resolved(self._shard().frozen)
        self._registrations[worker] = (spec, fut)
        return fut

    def rejoin(self, worker: int, spec: ModelSpec) -> Rejoined:
        """The replacement of `worker`, which died in this job (worker_loss wait), with the model `spec`: what the
        dead process sent of the step in flight is forgotten (`SyncRule.worker_restarted`); under async and ssp,
        the pieces of a push it did not finish (`AsyncRule.worker_restarted`).

        Raises:
            Refusal: this job replaces no worker, `worker` is none of its workers, or `spec` differs from worker
                0's model.
        """
        rule = self._replacing(worker, spec, self.replaces_workers, "wait")
        shard = self._shard()
        with shard.lock:
            if self._replay is not None:
                self._replay.restarted(worker)
        if self.staging is not None and self.mode != "sync":  # the pieces of a push the dead process did not finish
            self.staging.forget(worker)
        rejoined = Rejoined(shard.frozen, *rule.worker_restarted(worker))
        with shard.lock:
            journal = shard.journal
            return rejoined if journal is None else rejoined._replace(taken=journal.taken.get(worker, 0))

    def readmit(self, worker: int, spec: ModelSpec, number: int, step: int) -> Readmitted:
        """The `number`-th replacement of `worker`, whose process died in this sync job (worker_loss drop), with the
        model `spec`, asking to take part in the steps from `step` on (`SyncRule.readmit`).

        Raises:
            Refusal: this job drops no worker, `worker` is none of its workers, or `spec` differs from worker 0's
                model.
        """
        rule = self._replacing(worker, spec, self.worker_loss == "drop" and self.mode == "sync", "drop")
        assert isinstance(rule, SyncRule)  # a sync job's
        taken, closed = rule.readmit(worker, number, step)
        shard = self._shard()
        with shard.lock:  # the frozen parameters once it has begun that step: the answer the replacement keeps
            return Readmitted(shard.frozen if taken and closed == step else {}, taken, closed, shard.began_options())

    def _replacing(self, worker: int, spec: ModelSpec, allowed: bool, policy: str) -> ConsistencyRule:
        """The rule a replacement of `worker` with the model `spec` comes into, in a job whose `policy` replaces
        dead workers (`allowed`: this job's).

        Raises:
            Refusal: not `allowed`, not yet serving, `worker` is none of its workers, or `spec` differs from worker
                0's model.
        """
        with self._lock:
            rule, reference = self.rule, self._reference
            if not allowed or rule is None or worker not in self._registrations:
                raise Refusal(
                    f"worker {worker}'s replacement cannot join server {self.shard_id}: it joins a job with "
                    f"worker_loss '{policy}' as one of its {self.num_workers} workers, once every worker has registered"
                )
            assert reference is not None  # set with the rule
            if (diff := reference.difference(spec)) is not None:
                raise Refusal(str(model_mismatch_error(worker, diff)))
        return rule

    def _build(self, s: Setup) -> ShardState:
        """The shard from worker 0's setup, then, when resuming, its state from the checkpoint folder (written
        by any number of servers: `ps.reshard`)."""
        tables = {
            name: _TABLES[type(t)](name, t, self.shard_id, s.num_servers, self.mode != "sync")
            for name, t in s.tables.items()
        }
        if any(t.answers_calls for t in tables.values()):
            malloc.fix_mmap_threshold()  # its RSS follows the rows it holds (core/malloc.py)
        shard = ShardState(self.shard_id, s.buckets, s.params, s.buffers, s.optimizer, self.device, s.frozen, tables)
        shard.keep_before = self.replaces_workers and self.mode == "sync"
        if self.resume_from is not None:
            try:
                reshard.restore_folder(shard, *self.resume_from)
            except (ValueError, OSError) as e:
                error = ValueError(f"server {self.shard_id} cannot restore its shard: {e}")
                self.fail(f"{type(error).__name__}: {error}\n")
                raise error from e
        if self.replicated:
            shard.journal = StepJournal(None if self.link is None else self.link.send)
        return shard

    def _mismatch(self, registrations: dict[int, tuple[ModelSpec, torch.futures.Future]]) -> Exception | None:
        if 0 not in registrations or self._setup is None:
            return RuntimeError(f"server {self.shard_id}: worker 0 did not send the model's initial values")
        reference = registrations[0][0]
        for worker in sorted(registrations):
            diff = reference.difference(registrations[worker][0])
            if diff is not None:
                return model_mismatch_error(worker, diff)
        return None

    def pull(self) -> Snapshot:
        """The shard's current snapshot (shared by every pull and push reply of that version; never modified)."""
        shard = self._shard()
        with shard.lock:
            snapshot = shard.snapshot()
            shard.stats.bytes_out += snapshot.nbytes
        return snapshot

    def pull_rows(self, table: str, ids: torch.Tensor, before: bool = False) -> tuple[int, torch.Tensor]:
        """(version, a copy of the local rows `ids` of `table`); `before`: as the last closed step began (a dead
        worker's replacement redoing that step: `TableShard.pull`)."""
        shard = self._shard()
        with shard.lock:
            if table not in shard.tables:
                raise KeyError(f"server {self.shard_id} holds no table {table!r} (it holds {sorted(shard.tables)})")
            rows = _fixed(shard, table).pull(ids, before)
            shard.stats.bytes_out += rows.nbytes
            return shard.version, rows

    def reply(self, committed: Committed, whole: bool = True) -> Snapshot | Partial:
        """What a push's reply carries, from what its future resolved to: this server's part of a held step's
        norm (`Partial`), the snapshot the rule released the worker at (ssp), else the current snapshot, or,
        when its buckets came back as pieces (`whole` False), the snapshot's version and buffers alone; with the
        step's end on its dynamic tables (`Committed.ended`)."""
        if committed.partial is not None:
            return committed.partial
        if committed.snapshot is not None:
            return committed.snapshot
        if whole:
            return self.pull()._replace(ended=committed.ended)
        shard = self._shard()
        with shard.lock:
            buffers = {n: b.to("cpu", copy=True) for n, b in shard.buffers.items()}
            shard.stats.bytes_out += sum(b.nbytes for b in buffers.values())
            return Snapshot(committed.version, [], buffers, committed.ended)

    def table_call(self, call: TableCall):
        """A call on this server's dynamic tables (`ps.dynamic_shard.respond`; a lookup answers with the shard's
        version and counts its rows' bytes)."""
        shard = self._shard()
        with shard.lock:
            dynamic = {n: cast(DynamicShard, t) for n, t in shard.tables.items() if t.answers_calls}
            holder = f"server {self.shard_id}"
            if isinstance(call, Lookups) and self._replay is not None:
                answer = self._replay.answer(call, lambda: respond(dynamic, call, holder, shard.version))
            else:
                answer = respond(dynamic, call, holder, shard.version)
            if isinstance(call, Lookups):
                shard.stats.bytes_out += sum(rows.nbytes for rows, _ in answer[1])
            return answer

    def table_rows(self, table: str) -> torch.Tensor:
        """A copy of every row of `table` this server holds, in local order."""
        shard = self._shard()
        with shard.lock:
            return _fixed(shard, table).indexed_rows().clone()

    def push(
        self, worker: int, pulled_version: int, push: Push, wire=None, done: int | None = None
    ) -> torch.futures.Future:
        """One worker's step (`Push`) computed at `pulled_version`, its payloads in `wire`'s format (default:
        the job's); `push.payloads` None: a step whose buckets come as pieces (`push_piece`; async and ssp: it
        waits in `staging` for the pieces `push.pieces` names, then goes to the rule whole).
        Resolves to a `Committed` (in sync mode once all W pushed; in ssp mode once the worker may go on, with
        the `Snapshot` it goes on from; with `push.agree`, with this server's `Partial` of the held step's
        norm, and `finish` applies it), or fails with the reason. `done`: the steps this server has answered the
        worker closed (replicas 1): a push of a step closed here already is answered as it was (`ps.replica`).
        """
        shard = self._shard()
        if (closed := self._closed_for(worker, done)) is not None:
            return resolved(closed if push.agree is not None else dataclasses.replace(closed, partial=None))
        if self.mode != "async" and not 0 <= worker < self.num_workers:
            return self.rejected(
                GradientError(f"worker {worker} is not a worker of this job: expected 0 .. {self.num_workers - 1}")
            )
        if worker < 0:  # async: any worker may join and leave, under a non-negative id
            return self.rejected(GradientError(f"worker {worker} is not a worker id: expected an integer >= 0"))
        if self.staging is not None:
            if isinstance(push, PipelineHead):
                if push.pieces is None or len(push.pieces) != len(shard.buckets):
                    return self.rejected(
                        GradientError(
                            f"worker {worker} pushed no gradients to server {self.shard_id}, which runs a {self.mode} "
                            f"job, and named no piece for each of its {len(shard.buckets)} buckets"
                        )
                    )
                return self.staging.head(worker, pulled_version, push)
            if push.seq:
                self.staging.void(worker, push.seq)
        return self._commit(worker, pulled_version, push, wire)

    def _commit(self, worker: int, pulled_version: int, push: Push, wire=None) -> torch.futures.Future:
        assert self.rule is not None  # set with the shard, before any push is taken
        return self.rule.commit(worker, pulled_version, push, wire or self.wire)

    @property
    def pipelined(self) -> bool:
        """Whether a piece is answered with its bucket's values (sync: the pipeline), not the push (async, ssp:
        the push's reply brings the whole snapshot)."""
        return isinstance(self.rule, SyncRule)

    def push_piece(self, worker: int, pulled_version: int, piece: Piece, stamped: bool = False) -> torch.futures.Future:
        """One worker's gradient of this server's bucket `piece.bucket` in a step whose push carries none (in
        the job's wire format). Sync: resolves to the bucket's values after the step, sent as soon as every
        worker's part is in and the bucket is applied; with `stamped`, to a `metrics.timeline.Stamped` of them
        and the bucket's events on this server (the step timeline). Async and ssp: kept until its push comes
        (`staging`), and answered None at once (the push's reply brings the snapshot)."""
        shard = self._shard()
        if not 0 <= piece.bucket < len(shard.buckets):
            return self.rejected(
                GradientError(
                    f"worker {worker} pushed a piece of bucket {piece.bucket} to server "
                    f"{self.shard_id}, which holds {len(shard.buckets)} buckets"
                )
            )
        if self.staging is not None:
            if worker < 0 or not piece.seq:
                return self.rejected(
                    GradientError(
                        f"worker {worker} pushed an unnumbered piece or a bad worker id to server {self.shard_id}, "
                        f"which runs a {self.mode} job: its pieces must be numbered (Piece.seq > 0), from a worker >= 0"
                    )
                )
            return self.staging.piece(worker, piece)
        if not 0 <= worker < self.num_workers:
            return self.rejected(
                GradientError(f"worker {worker} is not a worker of this job: expected 0 .. {self.num_workers - 1}")
            )
        rule = self.rule
        assert isinstance(rule, SyncRule)  # no staging: the job's steps go as a pipeline (`pipelined`)
        stamps = rule.stamps

        def reply(applied: torch.futures.Future):
            return stamps.reply(piece.bucket, applied.value(), pulled_version, stamped)  # value(): raises its error

        return rule.commit_piece(worker, pulled_version, piece, self.wire).then(reply)

    def finish(
        self, worker: int, version: int, coefficient: float | None, done: int | None = None
    ) -> torch.futures.Future:
        """Apply the held sync step at `version` with its gradients times `coefficient`, or skip it (None):
        see `SyncRule.finish`; `done` as `push`'s."""
        self._shard()
        waits = isinstance(self.rule, SyncRule) and self.rule.awaits_word(worker, version)  # applied or not
        if not waits and (closed := self._closed_for(worker, done)) is not None:
            return resolved(dataclasses.replace(closed, partial=None))
        if not isinstance(self.rule, SyncRule):
            return self.rejected(
                GradientError(f"server {self.shard_id} runs a {self.mode} job, which holds no step to finish")
            )
        return self.rule.finish(worker, version, coefficient)

    def _closed_for(self, worker: int, done: int | None) -> Committed | None:
        """What answered `worker`'s step in flight, when this copy of the shard has closed it already (its answer
        was lost with the primary that closed it: `StepJournal.took`), else None."""
        if done is None:  # a job without replicas
            return None
        shard = self._shard()
        with shard.lock:
            journal = shard.journal
            if journal is None or not journal.took(worker, done):
                return None
            return Committed(shard.version, partial=journal.partial)

    def replicate(self, record: StepRecord) -> None:
        """Take a step (or a load) of this shard's primary on another server: this copy is its replica. A step is
        replayed after this returns, in order (`Replays`), a load at once."""
        if self._replays is None:
            self._replays = Replays(self._shard(), self.fail)
        if record.stats is not None:
            self._replays.put(record)
            return
        for name, args in record.entries:  # a load of the module or the optimizer's state, after the steps before
            getattr(self, name)(*args)

    def copy_for(self, name: str) -> ShardCopy:
        """This shard as it is now, for the server of RPC name `name`, which builds its replica anew (`adopt`); the
        steps after it are kept (`ReplicaLink.hold`) until that server has built it (`keep`)."""
        shard = self._shard()
        assert self.link is not None and self._layout is not None and shard.journal is not None  # replicated
        with shard.lock:
            journal = shard.journal
            self.link.hold(name)
            state = shard_file.captured(shard)
            return ShardCopy(
                _with_values(self._layout), state, copy.deepcopy(shard.stats), dict(journal.taken), journal.partial,
                shard.closed, self._loads,
            )  # fmt: skip

    def keep(self, name: str) -> None:
        """The server of RPC name `name` has built this shard's replica from its copy: the steps since go there,
        and every step from now on."""
        shard = self._shard()
        assert self.link is not None  # replicated
        with shard.lock:
            self.link.release(name)

    def adopt(self, copied: ShardCopy) -> None:
        """Build this shard, a replica, from its primary's copy (`copy_for`)."""
        shard = self._build(copied.setup)
        reshard.restore(shard, [copied.state], where=f"the copy of shard {self.shard_id}")
        assert shard.journal is not None  # replicated
        shard.stats, shard.closed, self._loads = copied.stats, copied.closed, copied.loads
        shard.journal.taken, shard.journal.partial = dict(copied.taken), copied.partial
        self.shard, self._layout = shard, _without_values(copied.setup)
        self.rule = make_rule(self.mode, shard, self.num_workers, self.nonfinite, self.staleness)
        self.ready.set()

    def optimizer_state(self) -> dict:
        """The optimizer's per-parameter state by entry key and its groups' options (CPU copies)."""
        shard = self._shard()
        with shard.lock:
            return shard.optimizer_state()

    def load_optimizer_state(self, state: dict, groups: list[dict]) -> None:
        """Replace the optimizer's state (by entry key) and its groups' options.

        Raises:
            Refusal: `state` or `groups` do not fit this server's optimizer.
        """
        shard = self._shard()
        with shard.lock:
            try:
                shard.load_optimizer_state(state, groups)
            except (ValueError, KeyError, TypeError) as e:
                raise Refusal(
                    f"the optimizer state does not fit server {self.shard_id}'s optimizer: {type(e).__name__}: {e}"
                ) from e
            shard.restored()
            if shard.journal is not None:
                shard.journal.record("load_optimizer_state", state, groups)
                shard.journal.flush()

    def load_values(self, number: int, flats: list[torch.Tensor], named: dict[str, torch.Tensor]) -> None:
        """A worker's `model.load_state_dict(...)`: this shard's buckets (`flats`, as `state()` answers them) and,
        by name, its buffers, frozen parameters and rows of served tables take the loaded values; the optimizer's
        state stays (as a `torch.optim` optimizer's does over a loaded module). Taken once per `number`: every
        worker sends the same load, and a later copy must not undo a step applied since (async).

        Raises:
            Refusal: a value does not fit this shard (nothing is changed).
        """
        shard = self._shard()
        with shard.lock:
            if number <= self._loads:
                return
            tables = {n: rows for n, t in shard.tables.items() if (rows := t.indexed_rows()) is not None}
            targets = {**shard.buffers, **shard.frozen, **tables}
            pairs = list(zip(shard.flats, flats)) + [(targets.get(n), v) for n, v in named.items()]
            if len(flats) != len(shard.flats) or any(t is None or t.shape != v.shape for t, v in pairs):
                raise Refusal(
                    f"server {self.shard_id} holds {len(shard.flats)} buckets and "
                    f"{sorted(targets)}: a load of {len(flats)} buckets and {sorted(named)} does not fit"
                )
            for target, value in pairs:
                assert target is not None  # refused above
                target.copy_(value)
            self._loads = number
            shard.restored()
            if shard.journal is not None:
                shard.journal.record("load_values", number, flats, named)
                shard.journal.flush()

    def worker_left(self, worker: int, steps: int | None) -> None:
        """`worker` left the job after `steps` steps (told by the heartbeat; None: it died, in an elastic job):
        a sync step waiting for it fails; before every worker has registered, every registration fails."""
        waiting: list[torch.futures.Future] = []
        with self._lock:
            rule = self.rule
            if rule is None:
                self._refusal = RuntimeError(
                    f"worker {worker} left the job before all {self.num_workers} workers had registered the model "
                    f"with server {self.shard_id}, which starts serving once every worker has built its Trainer"
                )
                waiting, self._registrations = [f for _, f in self._registrations.values()], {}
        if rule is not None:
            rule.worker_left(worker, steps)
        if self.staging is not None:
            self.staging.forget(worker)
        for fut in waiting:
            fut.set_exception(self._refusal)

    def dropped(self) -> frozenset[int]:
        """The workers this server's steps go on without now (worker_loss drop: `SyncRule.dropped`)."""
        return self.rule.dropped if isinstance(self.rule, SyncRule) else frozenset()

    def worker_joined(self, worker: int) -> None:
        """`worker` ran out of data this round (`trainer.join()`, told by `gradsync.membership.uneven_data`)."""
        if self.rule is not None:
            self.rule.worker_joined(worker)

    def state(self) -> tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]:
        """(version, bucket tensors, buffers, frozen parameters and this server's table rows by name): CPU
        copies at one version."""
        shard = self._shard()
        with shard.lock:
            named = shard.named_copies()
            named.update({n: rows.clone() for n, t in shard.tables.items() if (rows := t.indexed_rows()) is not None})
            return shard.version, [f.detach().to("cpu", copy=True) for f in shard.flats], named

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of this shard's tensors by name (a split parameter's piece as `name[start:end]`)."""
        shard = self._shard()
        with shard.lock:
            return shard.state_dict()

    def checkpoint(self, directory: str, base: str | None = None) -> tuple[str, int]:
        """Write this shard's state into `directory` (`ps.shard_file`); returns (path, version). `base`: the
        folder of the last full checkpoint this server wrote, onto which its dynamic tables' delta goes."""
        if base is not None and (self._last_full is None or os.path.abspath(base) != os.path.abspath(self._last_full)):
            raise ValueError(
                f"server {self.shard_id} was asked for a delta checkpoint onto {base}, and its last full "
                f"checkpoint is {self._last_full or 'none'}: write a full one first"
            )
        path, version = shard_file.save(self._shard(), directory, full=base is None)
        if base is None:
            self._last_full = directory
        return path, version

    def stats(self) -> dict:
        """This server's counters (version, pushes applied/rejected, staleness, bytes), its process id and host;
        with replicas, the RPC name of the server that keeps its replica ('': none)."""
        shard = self._shard()
        with shard.lock:
            stats = dataclasses.asdict(shard.stats)
        stats["workers_seen"] = sorted(stats["workers_seen"])
        if self.link is not None:  # replicas: where its replica is kept now ('': none)
            stats["replica"] = self.link.to or ""
        return {**stats, "pid": os.getpid(), "host": socket.gethostname()}

    def table_stats(self) -> dict[str, dict]:
        """Per embedding table on this server: rows and bytes held, rows pulled and pushed, largest staleness."""
        shard = self._shard()
        with shard.lock:
            return {n: dataclasses.asdict(t.stats) for n, t in shard.tables.items()}

    # What a transport's servicer reads and calls beyond the job's own calls (`gradsync.transport.grpc.servicer`).

    def layout(self) -> ShardLayout:
        """What this server holds (`ps.layout`: names, pieces of split parameters, tables, sizes) at its current
        version."""
        shard = self._shard()
        with shard.lock:
            return shard.layout()

    def pull_named(self, names: list[str]) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, the tensors `names` by name: parameters or their pieces, buffers, frozen parameters, every
        row of a table; no names: all of them). Raises KeyError for a name this server does not hold."""
        shard = self._shard()
        version, flats, buffers = self.pull()[:3]
        tensors: dict[str, torch.Tensor] = {}
        for bucket, flat in zip(shard.buckets, flats):
            tensors.update(bucket.views(flat))
        tensors.update(buffers)
        tensors.update(shard.frozen)
        wanted = names or list(tensors) + list(shard.tables)
        return version, {n: tensors[n] if n in tensors else self.table_rows(n) for n in wanted}

    def push_named(self, worker: int, pulled_version: int, grads: dict[str, torch.Tensor]) -> torch.futures.Future:
        """`push` with gradients (and buffers) by name, as clients outside the job send them (`ps.named_grads`)."""
        return push_named(self, worker, pulled_version, grads)

    def rejected(self, error: Exception) -> torch.futures.Future:
        """Count a push refused before its consistency rule saw it; the failed future that answers it (a caller
        that answers otherwise, as the gRPC servicer's refusals do, drops it)."""
        shard = self._shard()
        with shard.lock:
            return shard.rejected(error)

    def registered(self, worker: int) -> bool:
        """Whether `worker` registered the model here (the job's workers, and in async jobs those that joined)."""
        with self._lock:
            return worker in self._registrations

    def local_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """This server's local indices of the global row ids `ids` of `table`.

        Raises:
            GradientError: an id that is out of range or that another server holds.
        """
        return _fixed(self._shard(), table).local(ids)

    def fail(self, text: str) -> None:
        """This server has failed, for the reason `text`: told to `on_failure` once (the first failure is the
        cause; what follows from it is not)."""
        with self._failing:
            first, self.failed = not self.failed, True
        if first and self.on_failure is not None:
            self.on_failure(text)

    def fault(self, error: Exception, call: str, worker: int | None = None) -> Exception:
        """What answers `call` (of `worker`, when known) whose handler raised `error`: a `Refusal` of what the
        call carries as it is; any other exception is this server's own failure (`fail`, with its traceback),
        answered with an error that says so (`server_failure_error`)."""
        if isinstance(error, Refusal):
            return error
        self.fail(
            "".join(traceback.format_exception(error)) + f"gradsync: {failed_answering(self.shard_id, call, worker)}\n"
        )
        return server_failure_error(self.shard_id, call, worker, error)

    def _shard(self) -> ShardState:
        """The shard (a replica's once the records it took are replayed)."""
        if self.shard is None:
            raise RuntimeError(f"server {self.shard_id} has no model yet: every worker must create the Trainer")
        if self._replays is not None:
            self._replays.settle()
        return self.shard


def _without_values(setup: Setup) -> Setup:
    """`setup` without its tensors' values (their shapes and dtypes kept, on the meta device), what a replica
    built from a copy needs (`ParameterServer.copy_for`)."""
    empty = lambda tensors: {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}  # noqa: E731
    tables: dict[str, TableSetup | DynamicSetup] = {
        n: dataclasses.replace(t, values=None) for n, t in setup.tables.items() if isinstance(t, TableSetup)
    }
    return dataclasses.replace(
        setup, params=empty(setup.params), buffers=empty(setup.buffers), frozen=empty(setup.frozen), tables=tables
    )


def _with_values(layout: Setup) -> Setup:
    """`layout` (`_without_values`) with zeros for every tensor (a restore puts in every value)."""
    zeros = lambda tensors: {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in tensors.items()}  # noqa: E731
    return dataclasses.replace(
        layout, params=zeros(layout.params), buffers=zeros(layout.buffers), frozen=zeros(layout.frozen)
    )


def _fixed(shard: ShardState, table: str) -> TableShard:
    """`shard`'s part of the fixed table `table`: a worker asks rows by index only of its fixed tables."""
    return cast(TableShard, shard.tables[table])


_TABLES = {
    TableSetup: lambda name, t, server, servers, alone: TableShard(
        t.spec, server, servers, t.values, t.optimizer, t.padding_idx, t.group
    ),
    DynamicSetup: lambda name, t, server, servers, alone: DynamicShard(name, t, server, servers, alone=alone),
}
"""A server's part of a table, built from the table's setup (`ps.server_table.ServerTable`): (name, setup, this
server, the number of servers, alone: async or ssp)."""


def _usable_device(device: str) -> torch.device:
    """The server's shard device ('cuda': the GPU its LOCAL_RANK names, modulo the GPUs it sees, so that a
    machine's servers spread over its GPUs); refuses CUDA on a machine without it."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"server_device {device!r} asked for, but this server has no CUDA device: use --server-device cpu"
        )
    if device == "cuda":
        return torch.device("cuda", settings.LOCAL_RANK.read() % torch.cuda.device_count())
    return torch.device(device)


def make_rule(
    mode: str, shard: ShardState, num_workers: int, nonfinite: str, staleness: int = 0, drop: bool = False
) -> ConsistencyRule:
    """The consistency rule of `mode` ('sync', 'async', 'ssp') for `shard`; `drop`: a sync step goes on without
    a worker that died (worker_loss drop)."""
    if mode == "ssp":
        return SSPRule(shard, num_workers, nonfinite, staleness)
    if mode == "sync":
        return SyncRule(shard, num_workers, nonfinite, drop)
    return AsyncRule(shard, num_workers, nonfinite)
