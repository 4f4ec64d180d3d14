"""Futures that are answered at once: a value, or a refusal.

A parameter server answers every call with a `torch.futures.Future`; a call it
can answer without waiting (a bad push, a push applied at once) gets one of
these.
"""

from __future__ import annotations

import torch


def resolved(value) -> torch.futures.Future:
    """A future already resolved to `value`."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def failed(error: Exception) -> torch.futures.Future:
    """A future already failed with `error` (its `wait()` raises it)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(error)
    return fut
