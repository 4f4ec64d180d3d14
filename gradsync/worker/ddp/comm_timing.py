"""When an allreduce step communicates: how long it waits after its last gradient (to split that wait out of
compute), and, for the step timeline, when each bucket's allreduce was launched and completed.

DDP exchanges gradient buckets while the backward runs, and the backward returns only once the last
bucket's allreduce is done. A hook on every trainable parameter notes when the step's last gradient was
computed; from then until `trainer.step` the worker computes nothing and waits for the exchange. The
allreduce strategy counts that wait as commit (with the optimizer step), not as compute. The exchange
that overlaps the backward stays inside compute: it costs the step nothing beyond the CPU it takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from gradsync.metrics.timeline import Timeline
from gradsync.metrics.traffic import allreduce_bytes


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


def timed_hook(hook: Callable, timeline: Timeline, compression: str) -> Callable:
    """DDP comm hook `hook` (`ddp_hooks.make_ddp_hook`'s) with each bucket's events in `timeline`: launched,
    completed, and the bytes its allreduce moves through a link each way (`metrics.traffic.allreduce_bytes`).
    `hook` itself when the timeline is off."""
    if not timeline.on:
        return hook

    def timed(state, bucket):  # no annotations: DDP checks them, and this module's are strings
        workers = dist.get_world_size(state.process_group)
        nbytes = int(allreduce_bytes(bucket.buffer().numel(), workers, compression)[0])  # whole bytes, as metrics
        return timeline.exchanged(bucket.index(), nbytes, hook, state, bucket)

    return timed
