"""Async and ssp pushes whose gradients left during the backward: a server keeps each worker's pieces until
its push (a head: `Push.payloads` None, `Push.pieces` naming each bucket's piece) comes, then hands the rule
one whole push, as if it had come whole.

The pieces travel while the worker's backward runs (`gradsync.worker.streaming`); the rule still applies the
push at once, in one step, as async and ssp do. A piece's future resolves to None once its push is handed on
(or a later piece of the same bucket superseded it): the push's reply brings the whole snapshot. A sync step
needs none of this: its rule takes pieces bucket by bucket (`ps.sync_rule`).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable, NamedTuple

import torch

from gradsync.core.futures import resolved
from gradsync.ps.messages import Piece, Push
from gradsync.ps.piece_numbers import PieceNumbers


class _Staged(NamedTuple):
    piece: Piece
    fut: torch.futures.Future


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
        self._pieces: dict[tuple[int, int], _Staged] = {}
        self._numbers = PieceNumbers(buckets)
        self._heads: dict[int, _Head] = {}

    def piece(self, worker: int, piece: Piece) -> torch.futures.Future:
        """Keep `piece` (superseding this worker's earlier one of the bucket); resolves to None once handed on."""
        key = (worker, piece.bucket)
        with self._lock:
            if not self._numbers.take(worker, piece.bucket, piece.seq):
                return resolved(None)  # superseded before it came
            fut: torch.futures.Future = torch.futures.Future()
            old = self._pieces.get(key)
            self._pieces[key] = _Staged(piece, fut)
            whole = self._complete(worker)
        if old is not None:
            old.fut.set_result(None)
        self._hand_on(worker, whole)
        return fut

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
            gone = self._drop(worker)
        for staged in gone:
            staged.fut.set_result(None)

    def forget(self, worker: int) -> None:
        """`worker` left the job: drop what it left here."""
        with self._lock:
            gone = self._drop(worker)
            self._heads.pop(worker, None)
        for staged in gone:
            staged.fut.set_result(None)

    def _drop(self, worker: int) -> list[_Staged]:
        """Take out every piece `worker` left here (answer them outside the lock). Call with the lock held."""
        return [self._pieces.pop((worker, b)) for b in range(self.buckets) if (worker, b) in self._pieces]

    def _complete(self, worker: int) -> tuple[_Head, list[_Staged]] | None:
        """This worker's head and the pieces it names, taken out, once all are here. Call with the lock held."""
        head = self._heads.get(worker)
        if head is None:
            return None
        named = head.push.pieces
        staged = [self._pieces.get((worker, b)) for b in range(self.buckets)]
        if any(s is None or s.piece.seq != named[b] for b, s in enumerate(staged)):
            return None
        del self._heads[worker]
        for b in range(self.buckets):
            del self._pieces[(worker, b)]
        return head, staged

    def _hand_on(self, worker: int, whole: tuple[_Head, list[_Staged]] | None) -> None:
        """Commit a completed head as one whole push, and answer it and its pieces once the rule has. Outside
        the lock."""
        if whole is None:
            return
        head, staged = whole
        push = dataclasses.replace(head.push, payloads=[s.piece.payload for s in staged],
                                   absent=[tuple(s.piece.absent) for s in staged], pieces=None)
        committed = self.commit(worker, head.pulled_version, push)

        def forward(done: torch.futures.Future) -> None:
            try:
                head.fut.set_result(done.value())
            except Exception as e:  # the rule refused the push: its head says why
                head.fut.set_exception(e)
            for s in staged:
                s.fut.set_result(None)

        committed.add_done_callback(forward)
