"""torch.Tensor <-> `gradsync.Tensor` chunk messages, with strict validation on decode.

A tensor travels as one or more consecutive chunks carrying its name, dtype,
shape and total byte size; each chunk says at which byte offset its data
starts. `decode` accepts exactly the chunk sequences `encode` produces: anything
else (unknown dtype, a shape that does not match the byte count, a missing,
duplicate, out-of-order or oversized chunk, a tensor sent twice) raises a
ValueError naming the tensor and the field.
"""
from __future__ import annotations

import math
import sys
from typing import Iterable, Iterator

import torch

from gradsync.proto import gradsync_pb2 as pb

if sys.byteorder != "little":
    raise ImportError("gradsync's wire format is little-endian raw bytes; big-endian hosts are not supported")

CHUNK_BYTES = 1 << 20
"""Largest `data` field a sender puts in one chunk, and the most a receiver accepts."""

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype; raises ValueError for one gradsync does not send."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent: supported dtypes are {', '.join(DTYPES)}")
    return name


def encode(name: str, tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Tensor]:
    """The chunks of one tensor (at least one, even when it is empty).

    Args:
        name: the tensor's name, non-empty.
        tensor: any device; it is copied to CPU and made contiguous.
        chunk_bytes: the largest `data` per chunk.
    """
    if not name:
        raise ValueError("a tensor needs a non-empty name to be sent")
    dtype = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else None
    total = flat.numel() * flat.element_size()
    shape = list(tensor.shape)
    offset = 0
    while True:
        end = min(total, offset + chunk_bytes)
        data = raw[offset:end].tobytes() if raw is not None else b""
        yield pb.Tensor(name=name, dtype=dtype, shape=shape, total_bytes=total, offset=offset, data=data)
        offset = end
        if offset >= total:
            return


def encode_all(tensors: dict[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Tensor]:
    """The chunks of several named tensors, one tensor after the other."""
    for name, tensor in tensors.items():
        yield from encode(name, tensor, chunk_bytes)


class _Partial:
    """A tensor whose chunks are still arriving."""

    def __init__(self, chunk: pb.Tensor, budget: int | None, max_bytes: int | None):
        where = f"tensor {chunk.name!r}"
        if not chunk.name:
            raise ValueError("Tensor.name is empty: every chunk must name its tensor")
        if chunk.dtype not in DTYPES:
            raise ValueError(f"{where}: unknown Tensor.dtype {chunk.dtype!r}; expected one of {', '.join(DTYPES)}")
        if any(d < 0 for d in chunk.shape):
            raise ValueError(f"{where}: Tensor.shape {list(chunk.shape)} has a negative dimension")
        self.name, self.dtype, self.shape = chunk.name, DTYPES[chunk.dtype], tuple(chunk.shape)
        self.total = chunk.total_bytes
        expected = math.prod(self.shape) * self.dtype.itemsize
        if self.total != expected:
            raise ValueError(
                f"{where}: Tensor.total_bytes is {self.total} but shape {list(self.shape)} of {chunk.dtype} "
                f"needs {expected} bytes"
            )
        if budget is not None and self.total > budget:
            raise ValueError(
                f"{where}: Tensor.total_bytes {self.total} exceeds the {budget} bytes left of the {max_bytes} "
                "this call accepts (is it the right tensor for this server?)"
            )
        self.buffer = bytearray(self.total)
        self.received = 0

    def add(self, chunk: pb.Tensor) -> None:
        where = f"tensor {self.name!r}"
        if (chunk.dtype, tuple(chunk.shape), chunk.total_bytes) != (
            dtype_name(self.dtype), self.shape, self.total
        ):
            raise ValueError(f"{where}: a chunk changed Tensor.dtype, Tensor.shape or Tensor.total_bytes mid-tensor")
        if chunk.offset != self.received:
            raise ValueError(
                f"{where}: chunk at Tensor.offset {chunk.offset}, expected {self.received} "
                "(a chunk is missing, repeated or out of order)"
            )
        data = chunk.data  # each read of a bytes field makes a copy: read it once
        size = len(data)
        if size > CHUNK_BYTES:
            raise ValueError(f"{where}: chunk of {size} bytes exceeds the {CHUNK_BYTES}-byte limit on Tensor.data")
        if self.received + size > self.total:
            raise ValueError(
                f"{where}: chunk at Tensor.offset {chunk.offset} with {size} bytes runs past "
                f"Tensor.total_bytes {self.total}"
            )
        if size == 0 and self.total != 0:
            raise ValueError(f"{where}: empty Tensor.data in a chunk of a non-empty tensor")
        self.buffer[self.received : self.received + size] = data
        self.received += size

    @property
    def complete(self) -> bool:
        return self.received == self.total

    def tensor(self) -> torch.Tensor:
        if self.total == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(self.buffer, dtype=self.dtype).reshape(self.shape)


def decode(chunks: Iterable[pb.Tensor], max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Reassemble named tensors from their chunks, in the order they arrive.

    Args:
        chunks: `Tensor` messages as `encode_all` produces them.
        max_bytes: the most tensor bytes to accept in all (checked before allocating); None: no limit.
    Returns:
        Tensors by name (CPU, writable, not sharing memory with the messages).
    Raises:
        ValueError: naming the tensor and the field, for any sequence `encode_all` would not produce.
    """
    out: dict[str, torch.Tensor] = {}
    current: _Partial | None = None
    budget = max_bytes
    for chunk in chunks:
        if not isinstance(chunk, pb.Tensor):
            raise ValueError(f"expected a Tensor message, got {type(chunk).__name__}")
        if current is not None and chunk.name != current.name:
            raise ValueError(
                f"tensor {current.name!r} is truncated: {current.received} of {current.total} bytes arrived "
                f"before a chunk of {chunk.name!r}"
            )
        if current is None:
            if chunk.name in out:
                raise ValueError(f"tensor {chunk.name!r} was sent twice (duplicate Tensor.name)")
            current = _Partial(chunk, budget, max_bytes)
            if budget is not None:
                budget -= current.total
        current.add(chunk)
        if current.complete:
            out[current.name] = current.tensor()
            current = None
    if current is not None:
        raise ValueError(f"tensor {current.name!r} is truncated: {current.received} of {current.total} bytes arrived")
    return out
