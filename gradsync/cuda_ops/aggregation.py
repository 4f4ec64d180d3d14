"""The public aggregation function: the K-way sum the parameter server calls.

It normalises the arguments (a stacked tensor becomes a list of views) and
runs the `gradsync::aggregate` op through `ops.call`: the Triton kernel for
CUDA tensors, the PyTorch reference for CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import ops


def as_list(tensors: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """A list of K tensors from a list, or from a stacked [K, ...] tensor (as views, no copy)."""
    if isinstance(tensors, torch.Tensor):
        stacked_count(tensors, name)
        return list(tensors.unbind(0))
    return list(tensors)


def stacked_count(tensors: torch.Tensor, name: str) -> int:
    """K of a stacked [K, ...] input."""
    if tensors.dim() == 0:
        raise ValueError(f"{name}: a stacked input needs a leading K dimension, got a 0-d tensor")
    return tensors.shape[0]


def aggregate(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused K-way sum times `scale`, accumulated in fp32.

    Args:
        tensors: K same-shaped, same-dtype (fp32, fp16 or bf16) tensors on one device,
            as a list or stacked into one [K, ...] tensor.
        scale: multiplies the sum (e.g. 1 / K for the mean).
        out_dtype: dtype of the result; default the inputs' dtype.

    Returns:
        `(tensors[0] + ... + tensors[K-1]) * scale`, summed left to right in fp32.
        NaN and Inf propagate.
    """
    items = as_list(tensors, "tensors")
    if not items:
        raise ValueError("tensors: got an empty list; pass at least one tensor")
    return ops.call("aggregate", items[0].device, items, float(scale), out_dtype)
