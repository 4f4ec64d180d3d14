"""Async and ssp pushes whose gradients left during the backward: a server keeps each worker's pieces until
its push (a `PipelineHead`, its `pieces` naming each bucket's piece) comes, then hands the rule
one whole push, as if it had come whole.

The pieces travel while the worker's backward runs (`gradsync.worker.pipeline.streaming`); the rule still applies the
push at once, in one step, as async and ssp do. A piece is answered (None) as soon as it is kept: the push's
reply brings the whole snapshot. It must not wait for its push: a worker keeps at most a window of pieces
unanswered per server (`transport.base.window`) and sends its later pieces only as earlier ones are answered,
so a piece answered only once its push was whole waited for pieces that waited for it (a server with more of
a worker's pieces than the window: a parameter cut into pieces). A sync step needs none of this: its rule
takes pieces bucket by bucket (`ps.sync_rule`), and a piece there waits only for the other workers' parts.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import NamedTuple, cast

import torch

from gradsync.core.futures import resolved
from gradsync.ps.messages import Piece, Push
from gradsync.ps.piece_numbers import PieceNumbers


class _Head(NamedTuple):
    pulled_version: int
    push: Push
    fut: torch.futures.Future


class Staging:
    """One server's pieces by (worker, bucket), the latest of each, and each worker's head waiting for them.
    `commit(worker, pulled_version, push)`: the rule's, for the whole push; returns its future."""

    def __init__(self, buckets: int, commit: Callable[[int, int, Push], torch.futures.Future]):
        self.buckets = buckets
        self.commit = commit
        self._lock = threading.Lock()
        self._pieces: dict[tuple[int, int], Piece] = {}
        self._numbers = PieceNumbers(buckets)
        self._heads: dict[int, _Head] = {}

    def piece(self, worker: int, piece: Piece) -> torch.futures.Future:
        """Keep `piece` (superseding this worker's earlier one of the bucket, or void when a later one is here);
        resolves to None at once, kept or not (a head waiting for it takes it now)."""
        with self._lock:
            if not self._numbers.take(worker, piece.bucket, piece.seq):
                return resolved(None)  # superseded before it came
            self._pieces[(worker, piece.bucket)] = piece
            whole = self._complete(worker)
        self._hand_on(worker, whole)
        return resolved(None)

    def head(self, worker: int, pulled_version: int, push: Push) -> torch.futures.Future:
        """A push whose gradients come as pieces: handed to the rule once every piece it names is here."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._heads[worker] = _Head(pulled_version, push, fut)
            whole = self._complete(worker)
        self._hand_on(worker, whole)
        return fut

    def void(self, worker: int, seq: int) -> None:
        """A whole push numbered `seq` came from `worker`: its pieces numbered below are void."""
        with self._lock:
            self._numbers.void_below(worker, seq)
            self._drop(worker)

    def forget(self, worker: int) -> None:
        """`worker` left the job, or died and its replacement comes: drop what it left here (a push it had not
        completed is never applied) and its pieces' numbers (the replacement numbers its own)."""
        with self._lock:
            self._drop(worker)
            self._heads.pop(worker, None)
            self._numbers.forget(worker)

    def _drop(self, worker: int) -> None:
        """Drop every piece `worker` left here. Call with the lock held."""
        for b in range(self.buckets):
            self._pieces.pop((worker, b), None)

    def _complete(self, worker: int) -> tuple[_Head, list[Piece]] | None:
        """This worker's head and the pieces it names, taken out, once all are here. Call with the lock held."""
        head = self._heads.get(worker)
        if head is None:
            return None
        named = head.push.pieces
        assert named is not None  # a head that names no piece is refused (`ParameterServer.push`)
        staged = [self._pieces.get((worker, b)) for b in range(self.buckets)]
        if any(p is None or p.seq != named[b] for b, p in enumerate(staged)):
            return None
        del self._heads[worker]
        for b in range(self.buckets):
            del self._pieces[(worker, b)]
        return head, cast("list[Piece]", staged)  # every one here (above)

    def _hand_on(self, worker: int, whole: tuple[_Head, list[Piece]] | None) -> None:
        """Commit a completed head as one whole push, and answer the head once the rule has. Outside the lock."""
        if whole is None:
            return
        head, staged = whole
        fields = {f.name: getattr(head.push, f.name) for f in dataclasses.fields(Push)}
        push = Push(
            **{
                **fields,
                "payloads": [p.payload for p in staged],
                "absent": [tuple(p.absent) for p in staged],
                "pieces": None,
            }
        )
        committed = self.commit(worker, head.pulled_version, push)

        def forward(done: torch.futures.Future) -> None:
            try:
                head.fut.set_result(done.value())
            except Exception as e:  # the rule refused the push: its head says why
                head.fut.set_exception(e)

        committed.add_done_callback(forward)
