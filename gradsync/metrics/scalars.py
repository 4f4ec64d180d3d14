"""The JSON lines `gradsync compare` reads: the Trainer's step records, and `gradsync.log`'s scalars.

When the job runs under `gradsync compare` (which sets GRADSYNC_LOG_DIR), each worker appends to
`worker-<i>.jsonl` there: first the model's trainable elements, dense and in embedding tables (the Trainer's
line, for `gradsync compare --predict`); then a line per step the Trainer committed, whether or not the script
calls `gradsync.log`: the seconds since the Trainer was built and the wall-clock time of the commit, the step,
the step's record (pull, exchange, compute and commit seconds, bytes sent and received) and with
GRADSYNC_TIMELINE its timeline. A step's line is written once the step is whole (some strategies add to its
record after the commit): at the next step's commit, at the script's next `gradsync.log`, or when the worker
leaves the job or fails. A worker calls `gradsync.log(loss=loss.item(), samples=len(x))` once per step (and,
say, `gradsync.log(acc=accuracy)` at the end): each call appends a line of its own with the step and the values.
With GRADSYNC_TENSORBOARD_DIR (`compare --log-dir`) the values also go to a TensorBoard events file there.
Without either it does nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import TextIO

from gradsync.core.settings import LOG_DIR, TENSORBOARD_DIR
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.metrics.tensorboard import EventWriter


@dataclasses.dataclass
class WorkerLog:
    """What the worker's lines are written with: the Trainer's step metrics (`watch`), the time its lines count
    from, the newest step's line until it is written (`pending`), and the files (opened on first use)."""

    metrics: StepMetrics | None = None
    worker: int | None = None
    """This process's worker index, set when it enters a job (`runtime.cluster.set_running`)."""
    started: float = dataclasses.field(default_factory=time.monotonic)
    pending: dict | None = None
    """The newest committed step's line; its record and timeline are read when it is written (`flush`)."""
    file: TextIO | None = None
    board: EventWriter | None = None


CURRENT = WorkerLog()
"""The one holder of this process's log state (a process is one worker, with one Trainer, which calls
`watch`)."""


def watch(metrics: StepMetrics, elements: dict[str, int]) -> None:
    """Called by `Trainer`: under `gradsync compare` each step `metrics` commits gets its line, and times count
    from now. `elements` ({'dense': ..., 'tables': ...}) is logged once, as {"model": elements}."""
    flush()  # an earlier Trainer's last step
    CURRENT.metrics, CURRENT.started = metrics, time.monotonic()
    if directory := LOG_DIR.read():
        _write(directory, {"t": 0.0, "wall": time.time(), "model": elements})
        metrics.on_commit = _committed


def _committed() -> None:
    """A step was committed: the step before it is whole, so its line goes out; this one's waits (its record and
    timeline are the objects the strategy may still add to)."""
    flush()
    metrics = CURRENT.metrics
    assert metrics is not None  # a strategy's, which calls this
    CURRENT.pending = {
        "t": time.monotonic() - CURRENT.started,
        "wall": time.time(),
        "step": metrics.steps,
        "record": metrics.last(),
    }
    if metrics.timeline.on:
        CURRENT.pending["timeline"] = metrics.timeline.steps[-1]


def flush() -> None:
    """Write the newest step's line, if it is not written yet (at the next commit, at `log`, and when the worker
    leaves the job or fails)."""
    line, CURRENT.pending = CURRENT.pending, None
    if line is not None:
        _write(LOG_DIR.read(), {**line, "record": dataclasses.asdict(line["record"])})


def log(step: int | None = None, **values: float) -> None:
    """Record this worker's scalars, e.g. `gradsync.log(loss=loss.item(), samples=len(x))`.

    Args:
        step: the step they belong to (default: the number of steps the Trainer has committed).
        values: finite numbers by name (`samples`: the samples this worker processed in the step,
            for samples/s in `gradsync compare`).
    Raises:
        ValueError: a value that is not a finite number (naming it).
    """
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"gradsync.log({name}={value!r}): log finite numbers, e.g. {name}=loss.item()")
    directory, board = LOG_DIR.read(), TENSORBOARD_DIR.read()
    if not directory and not board:
        return
    metrics = CURRENT.metrics
    step = (metrics.steps if metrics is not None else 0) if step is None else step
    if board:
        _writer(board).scalars(step, values)
    if directory:
        flush()
        _write(directory, {"t": time.monotonic() - CURRENT.started, "wall": time.time(), "step": step, **values})


def _write(directory: str, line: dict) -> None:
    if CURRENT.file is None:
        os.makedirs(directory, exist_ok=True)
        CURRENT.file = open(os.path.join(directory, f"worker-{_worker()}.jsonl"), "a")
    CURRENT.file.write(json.dumps(line) + "\n")
    CURRENT.file.flush()


def _writer(directory: str) -> EventWriter:
    if CURRENT.board is None:
        CURRENT.board = EventWriter(directory, f"worker{_worker()}")
    return CURRENT.board


def _worker() -> int:
    if CURRENT.worker is None:
        raise RuntimeError("gradsync is not initialized in this process: call gradsync.init() first")
    return CURRENT.worker
