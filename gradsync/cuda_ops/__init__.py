"""Gradient aggregation ops (placeholder reference; the op module replaces this file)."""
from __future__ import annotations

import torch


def aggregate(tensors, scale: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum K same-shaped tensors (a list, or a stacked [K, ...] tensor) in fp32, times `scale`."""
    stacked = torch.stack(list(tensors)) if not isinstance(tensors, torch.Tensor) else tensors
    out = stacked.to(torch.float32).sum(0) * scale
    return out.to(out_dtype or stacked.dtype)
