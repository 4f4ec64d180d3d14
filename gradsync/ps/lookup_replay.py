"""A dead worker's lookups of dynamic tables, answered again to its replacement (worker_loss wait).

A lookup counts its ids (admission, lookup counts, recency), so a replacement that looks up again what its
dead process had looked up in the step in flight must not be counted twice. With `worker_loss` wait a server
keeps each worker's lookups of the last two steps with their answers, in the order they came; once a worker's
replacement has rejoined (`restarted`), its lookups of that step are answered from them, call by call, until
it asks for more than its dead process did (then as any lookup), so the tables end the step as they would
without the death. A replacement asking for other ids than its dead process did (its data not taken by
`trainer.start_step`, another RNG) is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradsync.core.errors import Refusal
from gradsync.ps.messages import Lookups


def _same(a: Lookups, b: Lookups) -> bool:
    return len(a.lookups) == len(b.lookups) and all(
        name == other and torch.equal(ids, theirs) and torch.equal(counts, their_counts)
        for (name, ids, counts), (other, theirs, their_counts) in zip(a.lookups, b.lookups)
    )


class LookupReplay:
    """Each worker's lookups of the last two steps and their answers. Call with the shard's lock held."""

    def __init__(self):
        self._answered: dict[tuple[int, int], list[tuple[Lookups, Any]]] = {}  # by (worker, step), in order
        self._replaying: dict[int, int] = {}  # a replacement: the index of its next call among its step's

    def restarted(self, worker: int) -> None:
        """`worker`'s replacement rejoined: its next lookups are answered as its dead process's were."""
        self._replaying[worker] = 0

    def answer(self, call: Lookups, fresh: Callable[[], Any]) -> Any:
        """The answer to `call`: its worker's dead process's, or `fresh()` (kept)."""
        if call.worker is None:
            return fresh()
        answered = self._answered.setdefault((call.worker, call.step), [])
        at = self._replaying.pop(call.worker, None)
        if at is not None and at < len(answered):
            asked, answer = answered[at]
            if not _same(asked, call):
                raise Refusal(
                    f"worker {call.worker}'s replacement looked up other ids of dynamic tables in step {call.step} "
                    "than its dead process did: a replacement takes each step's batch from the step "
                    "(trainer.start_step) and the dead process's RNG states, so that it looks up the same ids"
                )
            self._replaying[call.worker] = at + 1
            return answer
        answer = fresh()
        answered.append((call, answer))
        for key in [k for k in self._answered if k[1] < call.step - 1]:
            del self._answered[key]
        return answer
