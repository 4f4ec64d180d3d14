"""What a worker knows of its model: parameters, persistent buffers, and state_dict keys.

Parameters shared under several names (tied weights) are tracked once, under
their first name; `to_state_dict` restores every key of `model.state_dict()`.
"""

from __future__ import annotations

import torch
from torch import nn


def named_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module's unique parameters and its persistent buffers, by name, in registration order."""
    params: dict[str, torch.Tensor] = dict(module.named_parameters())
    keys = module.state_dict(keep_vars=True).keys()
    buffers = {n: b for n, b in module.named_buffers() if n in keys}
    return params, buffers


def to_state_dict(module: nn.Module, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Key `values` (by unique name) exactly as `module.state_dict()` is keyed, in its order."""
    params, buffers = named_tensors(module)
    canonical = {id(t): n for n, t in {**params, **buffers}.items()}
    out = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        name = canonical.get(id(tensor), key)
        if name not in values:
            raise KeyError(f"state_dict key {key!r} has no value on the servers (unique name {name!r})")
        out[key] = values[name]
    return out


def ordered(state: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """`state` and `extra` (tensors taken out of the module, such as served tables) in the order of `keys`,
    the module's original `state_dict` keys."""
    merged = {**state, **extra}
    return {k: merged[k] for k in keys}
