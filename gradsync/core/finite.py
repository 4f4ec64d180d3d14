"""A cheap NaN/Inf detector: one reduction per tensor instead of a full-size boolean mask.

NaN and Inf propagate through a sum, so a finite sum proves a finite tensor. A
sum of huge finite values can overflow to Inf: a tripped detector is only a
suspicion, confirmed by `first_nonfinite`, the exact (slower) search.
"""
from __future__ import annotations

import torch


def maybe_nonfinite(tensor: torch.Tensor) -> bool:
    """True if `tensor` may hold NaN/Inf (always True when it does; rarely, on overflow, when it does not)."""
    return not bool(torch.isfinite(tensor.sum(dtype=torch.float32)))


def first_nonfinite(named: dict[str, torch.Tensor]) -> str | None:
    """The name of the first tensor that really holds NaN/Inf, or None."""
    for name, tensor in named.items():
        if maybe_nonfinite(tensor) and not bool(torch.isfinite(tensor).all()):
            return name
    return None
