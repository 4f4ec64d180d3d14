"""Per-step timings and traffic of a worker, for the comparison table and benchmarks."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Callable

from gradsync.metrics.timeline import Timeline


@dataclasses.dataclass
class StepRecord:
    """One training step: seconds spent in each phase and bytes on the wire. `exchange_s`: the sharded
    strategy's all-to-all exchanges among the workers (lookups in the forward, row gradients at the step),
    neither compute nor commit."""

    pull_s: float = 0.0
    exchange_s: float = 0.0
    compute_s: float = 0.0
    commit_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def total_s(self) -> float:
        return sum(getattr(self, part) for part in STEP_PARTS)


STEP_PARTS = ("pull_s", "exchange_s", "compute_s", "commit_s")
"""The phases a step's time is split in, in the order they come (a step's seconds are their sum)."""


KEPT = 10_000
"""Step records kept (the newest): a long job's metrics stay a fixed size."""


class StepMetrics:
    """Collects a `StepRecord` per step: pull (in the forward), compute (until step), commit (step). Keeps the
    newest `KEPT`; `steps` counts them all. `timeline`: each step's pieces (`metrics.timeline`), when on.
    `on_commit`: called after each step's record is kept (`metrics.scalars` writes the step lines compare reads)."""

    def __init__(self):
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=KEPT)
        self.timeline = Timeline()  # per piece, when GRADSYNC_TIMELINE is on
        self.steps = 0
        self.on_commit: Callable[[], None] | None = None
        self._current = StepRecord()
        self._mark: float | None = None
        self._inside = 0.0  # communication seconds since the mark (row lookups in the forward)
        self._exchanges: list[tuple[float, float]] = []  # (began, seconds) of this step's all-to-alls

    def pulled(self, seconds: float, bytes_received: int) -> None:
        """A pull before the forward; marks the start of compute."""
        self._current.pull_s += seconds
        self._current.bytes_received += bytes_received
        self._mark, self._inside = time.perf_counter(), 0.0

    def rows_pulled(self, seconds: float, bytes_received: int) -> None:
        """A pull of embedding rows inside the forward: counted as pull, not compute."""
        self._current.pull_s += seconds
        self._current.bytes_received += bytes_received
        self._inside += seconds

    def exchanged(self, seconds: float, bytes_sent: int, bytes_received: int) -> None:
        """An all-to-all exchange among the workers that just ended (sharded: a lookup's in the forward, the
        row gradients' at the step): counted as exchange, neither compute nor commit."""
        self._current.exchange_s += seconds
        self._current.bytes_sent += bytes_sent
        self._current.bytes_received += bytes_received
        self._exchanges.append((time.perf_counter() - seconds, seconds))

    def committed(self, started: float, bytes_sent: int, bytes_received: int = 0) -> None:
        """The step's commit, timed from `started` (its last gradient) to now: compute is from the mark to
        `started`, less the pulls and exchanges in between; commit less the exchanges after `started`."""
        now = time.perf_counter()
        after = sum(s for began, s in self._exchanges if began >= started)
        if self._mark is not None:
            during = sum(s for began, s in self._exchanges if self._mark <= began < started)
            self._current.compute_s = started - self._mark - self._inside - during
        self._current.commit_s += now - started - after
        self._current.bytes_sent += bytes_sent
        self._current.bytes_received += bytes_received
        self.records.append(self._current)
        self.steps += 1
        self.timeline.committed(self.steps)
        self._current, self._mark, self._inside, self._exchanges = StepRecord(), None, 0.0, []
        if self.on_commit is not None:
            self.on_commit()

    def gathered_after_commit(
        self, what: str, seconds: float, bytes_sent: int, bytes_received: int, left: float
    ) -> None:
        """An all-gather among the workers that began at `left` (wall clock) after the newest step's commit and
        is over now (sharded: the end of a dynamic table's step): counted in that step as exchange, its lane
        'all-gather `what`' in that step's timeline."""
        if not self.records:
            return
        record = self.records[-1]
        record.exchange_s += seconds
        record.bytes_sent += bytes_sent
        record.bytes_received += bytes_received
        self.timeline.gathered_after(what, bytes_sent, bytes_received, left)

    def last(self) -> StepRecord | None:
        """The newest step's record; None before the first step."""
        return self.records[-1] if self.records else None

    def sent_after_commit(self, bytes_sent: int) -> None:
        """Bytes of the newest step sent after its commit was recorded (hybrid: the rows, after the dense step)."""
        self.records[-1].bytes_sent += bytes_sent

    def summary(self, skip: int = 1) -> dict[str, float]:
        """Medians over the kept steps (the first `skip` of the job are warm-up and left out when possible)."""
        warmup = max(0, skip - (self.steps - len(self.records)))  # those still kept
        records = list(self.records)[warmup:] or list(self.records)
        if not records:
            return {}
        med = lambda f: statistics.median(f(r) for r in records)  # noqa: E731
        return {
            "steps": self.steps,
            "step_s": med(lambda r: r.total_s),
            **{part: med(lambda r, part=part: getattr(r, part)) for part in STEP_PARTS},
            "bytes_sent": med(lambda r: r.bytes_sent),
            "bytes_received": med(lambda r: r.bytes_received),
        }
