"""An emulated straggler (`gradsync compare --straggler W:F`, or GRADSYNC_STRAGGLER=W:F): worker W's
forward and backward take F times as long, by sleeping (F - 1) times their duration before each commit.
`Trainer` commits through `slowed(strategy.step, worker)`, which is the strategy's step itself when the setting is
off: the emulation costs nothing outside `gradsync compare --straggler`."""
from __future__ import annotations

import time
from typing import Callable

from gradsync.core.settings import STRAGGLER


def parse(text: str) -> tuple[int, float]:
    """'1:2.0' -> (worker 1, factor 2.0); raises ValueError naming the text and the form."""
    try:
        worker, factor = text.split(":")
        worker, factor = int(worker), float(factor)
    except ValueError:
        raise ValueError(f"straggler {text!r}: expected WORKER:FACTOR, e.g. 1:2.0") from None
    if worker < 0 or factor < 1:
        raise ValueError(f"straggler {text!r}: the worker must be >= 0 and the factor >= 1")
    return worker, factor


def slowed(commit: Callable[..., None], worker: int) -> Callable[..., None]:
    """`commit` (a strategy's step) for worker `worker`: `commit` itself, at no cost, unless GRADSYNC_STRAGGLER
    names this worker; then a wrapper that sleeps (factor - 1) times the time since the last commit ended (or
    since now, for the first) before each commit."""
    raw = STRAGGLER.read()
    chosen, factor = parse(raw) if raw else (None, 1.0)
    if chosen != worker or factor == 1.0:
        return commit
    since = time.perf_counter()

    def slowed_commit(*args) -> None:
        nonlocal since
        time.sleep((factor - 1.0) * (time.perf_counter() - since))
        commit(*args)
        since = time.perf_counter()

    return slowed_commit
