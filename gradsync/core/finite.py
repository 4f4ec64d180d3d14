"""Cheap NaN/Inf detection for gradients.

A NaN or Inf anywhere in a tensor makes its sum non-finite, so one sum per
tensor (a single read, no allocation the size of the tensor) clears the common
case. A finite tensor whose sum overflows trips it too, so a tripped sum is
confirmed by an exact scan of that tensor; a scan that finds nothing was a
false alarm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def first_nonfinite(tensors: Sequence[torch.Tensor]) -> int | None:
    """Index of the first tensor holding a NaN or Inf.

    Args:
        tensors: tensors on one device (one host sync in all, on a GPU).

    Returns:
        The index, or None when every tensor is finite.
    """
    if not tensors:
        return None
    sums = torch.stack([t.sum() for t in tensors])
    tripped = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    return next((i for i in tripped if not bool(torch.isfinite(tensors[i]).all())), None)
