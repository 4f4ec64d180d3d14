"""How long an allreduce step waits for communication after its last gradient, to split it out of compute.

DDP exchanges gradient buckets while the backward runs, and the backward returns only once the last
bucket's allreduce is done. A hook on every trainable parameter notes when the step's last gradient was
computed; from then until `trainer.step` the worker computes nothing and waits for the exchange. The
allreduce strategy counts that wait as commit (with the optimizer step), not as compute. The exchange
that overlaps the backward stays inside compute: it costs the step nothing beyond the CPU it takes.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch


class LastGradient:
    """When the last gradient of the current step was computed (`perf_counter` seconds)."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self._at: float | None = None
        for p in params:
            p.register_hook(self._computed)

    def _computed(self, grad: torch.Tensor) -> None:
        self._at = time.perf_counter()

    def wait_before(self, start: float) -> float:
        """Seconds from the step's last gradient to `start` (when `trainer.step` began), and forget it;
        0 when no gradient was computed since the last call."""
        at, self._at = self._at, None
        return max(0.0, start - at) if at is not None else 0.0
