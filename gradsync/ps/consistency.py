"""Consistency rules: when a server applies the gradients its workers push.

Each rule is a `ConsistencyRule`, whose `commit` checks a push (a bad one changes nothing and fails its
future, naming the problem) and hands it over; the future resolves to a `Committed` (`ps.messages`: the
shard's version after the step, and what the reply carries beyond it), or fails with the reason. The rules:
`ps.sync_rule.SyncRule` (a step of the mean of all workers' gradients, bucket by bucket), and
`ps.async_rules.AsyncRule` and `SSPRule` (each push applied as it arrives; SSP bounds how far a worker runs
ahead). `ps.server.make_rule` picks one by the job's mode.

NaN/Inf is found with one cheap reduction per bucket (`core.finite`); only when it trips are the parameter
and the worker searched for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from gradsync.core.errors import GradientError
from gradsync.core.futures import failed
from gradsync.ps.averaging import validated
from gradsync.ps.gradient_codecs import PLAIN
from gradsync.ps.messages import Push
from gradsync.ps.shard import ShardState


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
        answer(answers)
        return fut

    def _refused(self, worker: int, push: Push) -> torch.futures.Future | None:
        """The failed future that answers this push before it is checked, if any. Call with the lock held."""
        return None

    @abstractmethod
    def _take(
        self, worker: int, pulled_version: int, push: Push, checked: list | None, buffers: dict, wire
    ) -> tuple[torch.futures.Future, list[tuple]]:
        """A checked push (`checked`: its payloads on the shard's device, `buffers` its buffers): the future
        that answers it and the answers to give outside the lock. Call with the lock held."""

    @abstractmethod
    def worker_left(self, worker: int, steps: int | None) -> None:
        """`worker` left the job after `steps` steps."""

    @abstractmethod
    def worker_joined(self, worker: int) -> None:
        """`worker` ran out of data this round (`trainer.join()`)."""

    @abstractmethod
    def worker_restarted(self, worker: int) -> tuple[int, Any, Any, Any, list[dict]]:
        """`worker` died and its replacement takes its place (worker_loss wait): `Rejoined`'s closed, begun,
        before, partial and options."""


def answer(answers: list[tuple]) -> None:
    """Resolve futures outside the lock: (future, value, error) each."""
    for fut, value, error in answers:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
