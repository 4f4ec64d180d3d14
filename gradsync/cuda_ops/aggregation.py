"""Public aggregation functions: the K-way sum and its bucket-list form.

These are what the parameter server and the DDP hook call. They normalise
the arguments (a stacked tensor becomes a list of views, a per-worker bucket
list becomes one flat list) and call the `gradsync::aggregate*` ops, whose
dispatcher runs the Triton kernel for CUDA tensors and the PyTorch reference
for CPU tensors.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _unflatten_dense_tensors

from . import ops


def as_list(tensors: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """A list of K tensors from a list, or from a stacked [K, ...] tensor (as views, no copy)."""
    if isinstance(tensors, torch.Tensor):
        if tensors.dim() == 0:
            raise ValueError(f"{name}: a stacked input needs a leading K dimension, got a 0-d tensor")
        return list(tensors.unbind(0))
    return list(tensors)


def aggregate(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused K-way sum times `scale`, accumulated in fp32.

    Args:
        tensors: K same-shaped, same-dtype (fp32, fp16 or bf16) tensors on one device,
            as a list or stacked into one [K, ...] tensor.
        scale: multiplies the sum (e.g. 1 / K for the mean).
        out_dtype: dtype of the result; default the inputs' dtype.
        out: optional contiguous tensor of the inputs' shape to write the result into
            (its dtype is the output dtype); it may be one of the inputs, to accumulate
            in place: `aggregate([acc, grad], out=acc)`.

    Returns:
        `(tensors[0] + ... + tensors[K-1]) * scale`, summed left to right in fp32;
        `out` when given. NaN and Inf propagate.
    """
    items = as_list(tensors, "tensors")
    if not items:
        raise ValueError("tensors: got an empty list; pass at least one tensor")
    if out is None:
        return ops.aggregate(items, float(scale), out_dtype)
    if out_dtype is not None and out_dtype != out.dtype:
        raise TypeError(f"out_dtype: {out_dtype} disagrees with out.dtype {out.dtype}; pass one of them")
    ops.aggregate_into(items, float(scale), out)
    return out


def aggregate_buckets(
    per_worker: Sequence[Sequence[torch.Tensor]],
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """`aggregate` over a whole bucket list in one call.

    Args:
        per_worker: one bucket list per worker (K lists of B tensors); bucket b must have
            the same shape and dtype in every worker's list. Buckets may differ in shape.
        scale: multiplies every sum.
        out_dtype: dtype of the results; default the buckets' dtype (then they must share one).

    Returns:
        B tensors, bucket b being `sum_w per_worker[w][b] * scale` in bucket b's shape.
        They are views into one flat buffer.
    """
    workers = [list(w) for w in per_worker]
    if not workers:
        raise ValueError("per_worker: got no workers; pass one bucket list per worker")
    for w, buckets in enumerate(workers):
        if len(buckets) != len(workers[0]):
            raise ValueError(
                f"per_worker: per_worker[{w}] has {len(buckets)} buckets but per_worker[0] has "
                f"{len(workers[0])}; every worker must pass the same bucket list"
            )
    if not workers[0]:
        raise ValueError("per_worker: the bucket lists are empty; pass at least one bucket per worker")
    flat = ops.aggregate_buckets([t for w in workers for t in w], len(workers), float(scale), out_dtype)
    return list(_unflatten_dense_tensors(flat, workers[0]))
