"""gradsync's form of `torch.amp.GradScaler`: `trainer.step(context_id, scaler=scaler)`.

The loss is scaled as usual (`dist_autograd.backward(cid, [scaler.scale(loss)])`);
the Trainer unscales the gradients before clipping (`inverse_scale`), skips the
step on every worker and server alike when the unscaled gradients hold an
inf/NaN, and updates the scale. `record_found_inf` tells the scaler the
outcome through its public API (`unscale_`, `step`, `update` of a stand-in
optimizer), so it backs off or grows exactly as after `scaler.step(optimizer)`.
"""

from __future__ import annotations

import math

import torch


class _Flag(torch.optim.Optimizer):
    """An optimizer over one stand-in tensor, whose gradient carries a step's found-inf to a GradScaler."""

    def __init__(self):
        super().__init__([torch.zeros(1, requires_grad=True)], {})

    def step(self, closure=None):
        return None


def record_found_inf(scaler: torch.amp.GradScaler, found_inf: bool) -> None:
    """Update `scaler` after a step whose unscaled gradients did (or did not) hold an inf/NaN, on every worker
    alike: the scale backs off (and the step was skipped) or grows as after `scaler.step(opt)`."""
    flag = _Flag()
    stand_in = flag.param_groups[0]["params"][0]
    stand_in.grad = torch.full((1,), math.inf if found_inf else 0.0)
    scaler.unscale_(flag)
    scaler.step(flag)
    scaler.update()


def inverse_scale(scaler: torch.amp.GradScaler | None) -> float:
    """1 / the scale the loss was multiplied by (1.0 without a scaler)."""
    return 1.0 if scaler is None or not scaler.is_enabled() else 1.0 / scaler.get_scale()
