"""`gradsync.log`: a training script's per-step scalars (loss, accuracy, ...) for `gradsync compare`.

A worker calls `gradsync.log(loss=loss.item())` once per step (and, say,
`gradsync.log(acc=accuracy)` at the end). When the job runs under `gradsync
compare` (which sets GRADSYNC_LOG_DIR), each call appends one JSON line to
`worker-<i>.jsonl` there: the seconds since the worker's Trainer was built, the
wall-clock time, the step, the values, the Trainer's last step record (pull, compute and commit
seconds, bytes sent and received), and with GRADSYNC_TIMELINE that step's timeline. The Trainer's first
line names the model's trainable elements, dense and in embedding tables (for `gradsync compare --predict`).
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

from gradsync.metrics.tensorboard import EventWriter
from gradsync.core.settings import LOG_DIR, TENSORBOARD_DIR
from gradsync.metrics.step_metrics import StepMetrics


@dataclasses.dataclass
class WorkerLog:
    """What `gradsync.log` writes with: the worker's step metrics (`watch`), the time its lines count from, and
    the files it writes to (opened on first use)."""

    metrics: StepMetrics | None = None
    worker: int | None = None
    """This process's worker index, set when it enters a job (`runtime.cluster.set_running`)."""
    started: float = dataclasses.field(default_factory=time.monotonic)
    file: TextIO | None = None
    board: EventWriter | None = None


CURRENT = WorkerLog()
"""The one holder of this process's `gradsync.log` state (a process is one worker, with one Trainer, which
calls `watch`)."""


def watch(metrics: StepMetrics, elements: dict[str, int]) -> None:
    """Called by `Trainer`: its step records (`metrics`) go with each logged line, and times count from now.
    `elements` ({'dense': ..., 'tables': ...}) is logged once, as {"model": elements}."""
    CURRENT.metrics, CURRENT.started = metrics, time.monotonic()
    if directory := LOG_DIR.read():
        _write(directory, {"t": 0.0, "wall": time.time(), "model": elements})


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
    last = metrics.last() if metrics is not None else None
    step = (metrics.steps if metrics is not None else 0) if step is None else step
    if board:
        _writer(board).scalars(step, values)
    if directory:
        line = {"t": time.monotonic() - CURRENT.started, "wall": time.time(), "step": step, **values}
        if last is not None:
            line["record"] = dataclasses.asdict(last)
        if metrics is not None and metrics.timeline.steps:
            line["timeline"] = metrics.timeline.steps[-1]
        _write(directory, line)


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
