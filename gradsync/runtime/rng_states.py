"""A worker's RNG states: torch's (CPU and every CUDA device) and Python `random`'s, taken and put back whole.

A checkpoint's worker file holds them (`runtime.checkpoints`), and so does the record each step of a job whose dead
workers are replaced leaves for a replacement (`runtime.replacement`). NumPy's RNG is not among them.
"""

from __future__ import annotations

import json
import random
import struct

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


def packed(step: int) -> bytes:
    """`taken()` and `step` as bytes, cheaply (each step of a job whose dead workers are replaced writes them:
    `runtime.replacement`): every state's length, then torch's states as they are, then Python's as JSON."""
    states = taken()
    tensors = [states["torch_rng"], *states["cuda_rng"]]
    raw = [t.numpy().tobytes() for t in tensors]
    python = json.dumps([step, *states["python_rng"]]).encode()
    return struct.pack(f"<I{len(raw)}I", len(raw), *map(len, raw)) + b"".join(raw) + python


def unpacked(data: bytes) -> tuple[int, dict]:
    """(step, states) from `packed`'s bytes."""
    (count,) = struct.unpack_from("<I", data)
    lengths = struct.unpack_from(f"<{count}I", data, 4)
    at, tensors = 4 + 4 * count, []
    for n in lengths:
        tensors.append(torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8))
        at += n
    step, version, internal, gauss = json.loads(data[at:])
    states = dict(torch_rng=tensors[0], python_rng=(version, tuple(internal), gauss), cuda_rng=tensors[1:])
    return step, states
