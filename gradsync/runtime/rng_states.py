"""A worker's RNG states: torch's (CPU and every CUDA device) and Python `random`'s, taken and put back whole.

A checkpoint's worker file holds them (`runtime.checkpoints`), and so does the record each step of a job whose dead
workers are replaced leaves for a replacement (`runtime.replacement`). NumPy's RNG is not among them.
"""

from __future__ import annotations

import random

import torch


def taken() -> dict:
    """This process's RNG states, by the keys a checkpoint's worker file uses."""
    return dict(
        torch_rng=torch.get_rng_state(),
        python_rng=random.getstate(),
        cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    )


def put_back(states: dict) -> None:
    """Make `states` (what `taken` returned) this process's RNG states."""
    torch.set_rng_state(states["torch_rng"])
    random.setstate(states["python_rng"])
    if states["cuda_rng"]:
        torch.cuda.set_rng_state_all(states["cuda_rng"])
