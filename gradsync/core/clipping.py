"""Gradient clipping by total norm, as `torch.nn.utils.clip_grad_norm_` computes it, in parts.

`Clipping` holds `Trainer(max_grad_norm=..., grad_norm_type=..., error_if_nonfinite=...)`. The total norm
of the step's gradient is combined from partial sums (`partial`: sum of |g|^p, or the largest |g| for the
inf-norm), so parameter servers that each hold a part of the averaged gradient agree on it (`total`), and
every part is scaled by the same `coefficient`.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Clipping:
    """Clip the step's gradient to total `norm_type`-norm `max_norm` (None: measure nothing)."""

    max_norm: float | None = None
    norm_type: float = 2.0
    error_if_nonfinite: bool = False

    def __post_init__(self):
        if self.max_norm is not None and not (isinstance(self.max_norm, (int, float)) and self.max_norm > 0):
            raise ValueError(
                f"max_grad_norm={self.max_norm!r}: expected a number > 0 (float('inf') measures the "
                "norm without clipping), or None for no clipping"
            )
        if not (isinstance(self.norm_type, (int, float)) and self.norm_type > 0):
            raise ValueError(
                f"grad_norm_type={self.norm_type!r}: expected a number > 0 or float('inf'), as "
                "torch.nn.utils.clip_grad_norm_ takes"
            )

    @property
    def on(self) -> bool:
        return self.max_norm is not None

    def partial(self, tensors: list[torch.Tensor]) -> float:
        """This part's contribution to the total norm: sum of |g|^p over `tensors` (max |g| for p = inf)."""
        if not tensors:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(t, self.norm_type, dtype=torch.float64) for t in tensors])
        return float(norms.max() if math.isinf(self.norm_type) else norms.pow(self.norm_type).sum())

    def total(self, partials: list[float]) -> float:
        """The total norm from every part's `partial`, in a fixed order (every worker gets the same float)."""
        if math.isinf(self.norm_type):
            return max(partials, default=0.0)
        return math.fsum(partials) ** (1.0 / self.norm_type)

    def coefficient(self, total: float) -> float:
        """What every gradient is multiplied by: max_norm / (total + 1e-6), at most 1, as torch computes it.

        Raises:
            RuntimeError: the total is NaN/Inf and error_if_nonfinite is set (torch's error).
        """
        if not math.isfinite(total):
            if self.error_if_nonfinite:
                raise RuntimeError(
                    f"The total norm of order {self.norm_type} for gradients from `parameters` is non-finite, so "
                    "it cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                    "anyway, set `error_if_nonfinite=False`"
                )
            return 1.0
        assert self.max_norm is not None  # called only when `on`
        return min(1.0, self.max_norm / (total + 1e-6))

    def clip_local(self, tensors: list[torch.Tensor]) -> float:
        """Measure and clip (in place) a gradient held whole by this worker; returns the norm before clipping."""
        total = self.total([self.partial(tensors)])
        coef = self.coefficient(total)
        if coef < 1.0:
            for t in tensors:
                t.mul_(coef)
        return total
