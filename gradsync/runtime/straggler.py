"""An emulated straggler (`gradsync compare --straggler W:F`, or GRADSYNC_STRAGGLER=W:F): worker W's forward and
backward take F times as long, by sleeping (F - 1) times their duration before each commit.

Off the hot path unless asked for: `straggler_of(worker)` is None unless the setting names this worker with a
factor above 1, and then the Trainer commits through `Straggler.slowed(strategy.step)`; otherwise it calls the
strategy's step itself."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from gradsync.core.settings import STRAGGLER


def parse(text: str) -> tuple[int, float]:
    """'1:2.0' -> (worker 1, factor 2.0); raises ValueError naming the text and the form."""
    try:
        worker_text, factor_text = text.split(":")
        worker, factor = int(worker_text), float(factor_text)
    except ValueError:
        raise ValueError(f"straggler {text!r}: expected WORKER:FACTOR, e.g. 1:2.0") from None
    if worker < 0 or factor < 1:
        raise ValueError(f"straggler {text!r}: the worker must be >= 0 and the factor >= 1")
    return worker, factor


@dataclasses.dataclass(frozen=True)
class Straggler:
    """This worker, made `factor` times slower."""

    factor: float

    def slowed(self, commit: Callable[..., None]) -> Callable[..., None]:
        """`commit` (a strategy's step) behind a sleep of (factor - 1) times the time since the last commit
        ended (or since now, for the first) before each commit."""
        since = time.perf_counter()

        def slowed_commit(*args) -> None:
            nonlocal since
            time.sleep((self.factor - 1.0) * (time.perf_counter() - since))
            commit(*args)
            since = time.perf_counter()

        return slowed_commit


def straggler_of(worker: int) -> Straggler | None:
    """The straggler GRADSYNC_STRAGGLER makes of worker `worker`; None when the setting is unset, names another
    worker or a factor of 1 (raises ValueError when it is malformed: `parse`)."""
    raw = STRAGGLER.read()
    chosen, factor = parse(raw) if raw else (None, 1.0)
    return Straggler(factor) if chosen == worker and factor != 1.0 else None
