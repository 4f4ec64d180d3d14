"""An emulated straggler (`gradsync compare --straggler W:F`, or GRADSYNC_STRAGGLER=W:F): worker W's
forward and backward take F times as long, by sleeping (F - 1) times their duration before each commit."""
from __future__ import annotations

import time

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


class Straggler:
    """Slows this worker down when GRADSYNC_STRAGGLER names it; otherwise does nothing."""

    def __init__(self, worker: int):
        raw = STRAGGLER.read()
        chosen, factor = parse(raw) if raw else (None, 1.0)
        self.factor = factor if chosen == worker else 1.0
        self._since = time.perf_counter()

    def delay(self) -> None:
        """Before a commit: sleep (factor - 1) times the time since the last commit ended."""
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * (time.perf_counter() - self._since))

    def committed(self) -> None:
        self._since = time.perf_counter()
