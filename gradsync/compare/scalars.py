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

from gradsync.compare.tensorboard import EventWriter
from gradsync.core.settings import LOG_DIR, TENSORBOARD_DIR

_trainer = None  # the worker's Trainer (`watch`), whose step records a line carries
_started = time.monotonic()
_file = None
_board: EventWriter | None = None


def watch(trainer, elements: dict[str, int]) -> None:
    """Called by `Trainer`: its step records go with each logged line, and times count from now.
    `elements` ({'dense': ..., 'tables': ...}) is logged once, as {"model": elements}."""
    global _trainer, _started
    _trainer, _started = trainer, time.monotonic()
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
    metrics = _trainer.metrics if _trainer is not None else None
    records = metrics.records if metrics is not None else ()
    step = (metrics.steps if metrics is not None else 0) if step is None else step
    if board:
        _writer(board).scalars(step, values)
    if directory:
        line = {"t": time.monotonic() - _started, "wall": time.time(), "step": step, **values}
        if records:
            line["record"] = dataclasses.asdict(records[-1])
        if metrics is not None and metrics.timeline.steps:
            line["timeline"] = metrics.timeline.steps[-1]
        _write(directory, line)


def _write(directory: str, line: dict) -> None:
    global _file
    if _file is None:
        os.makedirs(directory, exist_ok=True)
        _file = open(os.path.join(directory, f"worker-{_worker()}.jsonl"), "a")
    _file.write(json.dumps(line) + "\n")
    _file.flush()


def _writer(directory: str) -> EventWriter:
    global _board
    if _board is None:
        _board = EventWriter(directory, f"worker{_worker()}")
    return _board


def _worker() -> int:
    from gradsync.runtime import cluster

    return cluster.worker_rank()
