"""Wire formats of pushed gradients: plain, fp16/bf16, or int8 with per-block scales.

A `WireFormat` is the one policy both ends share. The worker `encode`s each
bucket's gradient (int8 keeps an error-feedback residual per bucket); the
server `validate`s what arrives and in sync mode turns the K workers'
payloads into their mean in one fused pass (`mean`:
`aggregate` for plain and 16-bit payloads, `dequantize_aggregate` for int8).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from gradsync.core.buckets import Bucket
from gradsync.core.errors import GradientError
from gradsync.cuda_ops import (
    DEFAULT_BLOCK_SIZE,
    Int8Compressed,
    aggregate,
    compress,
    compress_int8,
    decompress_int8,
    dequantize_aggregate,
)


def _expect(worker: int, bucket: Bucket, what: str, got: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape or got.dtype != dtype:
        described = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
        raise GradientError(
            f"worker {worker}: {what} of bucket {bucket.index} ({bucket.entries[0].name}, ...) "
            f"is {described}, expected {shape} {dtype}"
        )


class WireFormat(Protocol):
    """How a bucket's gradient travels, on both ends: its payload is a tensor, or an `Int8Compressed`."""

    name: str
    stateful: bool

    def encode(self, grad: torch.Tensor, key: int) -> Any: ...

    def validate(self, worker: int, bucket: Bucket, payload: Any) -> None: ...

    def decode(self, payload: Any, dtype: torch.dtype) -> torch.Tensor: ...

    def mean(self, payloads: list, dtype: torch.dtype, scale: float) -> torch.Tensor: ...

    def to_device(self, payload: Any, device: torch.device) -> Any: ...

    def nbytes(self, payload: Any) -> int: ...


class PlainWire:
    """Gradients travel in the parameters' own dtype."""

    name = "none"
    stateful = False  # whether encoding a gradient changes how the next is encoded

    def encode(self, grad: torch.Tensor, key: int):
        return grad

    def validate(self, worker: int, bucket: Bucket, payload) -> None:
        _expect(worker, bucket, "gradient", payload, (bucket.numel,), bucket.dtype)

    def decode(self, payload, dtype: torch.dtype) -> torch.Tensor:
        return payload

    def mean(self, payloads: list, dtype: torch.dtype, scale: float) -> torch.Tensor:
        """`scale` times the sum of the payloads (scale = 1 / W for the mean over W workers)."""
        return aggregate(payloads, scale, dtype)

    def to_device(self, payload, device: torch.device):
        return payload.to(device)

    def nbytes(self, payload) -> int:
        return payload.nbytes


class HalfWire(PlainWire):
    """Gradients travel as fp16 or bf16 (half the bytes of fp32)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def encode(self, grad: torch.Tensor, key: int):
        return compress(grad, self.dtype)

    def validate(self, worker: int, bucket: Bucket, payload) -> None:
        _expect(worker, bucket, f"{self.name} gradient", payload, (bucket.numel,), self.dtype)

    def decode(self, payload, dtype: torch.dtype) -> torch.Tensor:
        return payload.to(dtype)


class Int8Wire:
    """Gradients travel as int8 with one fp32 scale per block, with error feedback on the worker."""

    name = "int8"
    stateful = True  # the residual: each step's gradient must be encoded once (no piece sent ahead of the step)

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size
        self.residuals: dict[int, torch.Tensor] = {}

    def encode(self, grad: torch.Tensor, key: int) -> Int8Compressed:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != grad.shape:
            residual = self.residuals[key] = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        return compress_int8(grad, residual, self.block_size)

    def validate(self, worker: int, bucket: Bucket, payload) -> None:
        if not isinstance(payload, Int8Compressed) or payload.block_size != self.block_size:
            raise GradientError(
                f"worker {worker}: bucket {bucket.index} gradient is not int8 with block size {self.block_size}"
            )
        blocks = -(-bucket.numel // self.block_size)
        _expect(worker, bucket, "int8 gradient", payload.payload, (bucket.numel,), torch.int8)
        _expect(worker, bucket, "int8 scales", payload.scales, (blocks,), torch.float32)

    def decode(self, payload: Int8Compressed, dtype: torch.dtype) -> torch.Tensor:
        return decompress_int8(payload, out_dtype=dtype)

    def mean(self, payloads: list[Int8Compressed], dtype: torch.dtype, scale: float) -> torch.Tensor:
        return dequantize_aggregate(
            [p.payload for p in payloads], [p.scales for p in payloads], self.block_size, scale, dtype
        )

    def to_device(self, payload: Int8Compressed, device: torch.device) -> Int8Compressed:
        return Int8Compressed(payload.payload.to(device), payload.scales.to(device), payload.block_size)

    def nbytes(self, payload: Int8Compressed) -> int:
        return payload.payload.nbytes + payload.scales.nbytes


PLAIN = PlainWire()
"""The format of gradients that arrive uncompressed (through distributed autograd, or gRPC pushes)."""


def make_wire(compression: str) -> WireFormat:
    """The wire format for a job's `compression` setting."""
    formats: dict[str, Callable[[], WireFormat]] = {
        "none": lambda: PLAIN,
        "fp16": lambda: HalfWire(torch.float16),
        "bf16": lambda: HalfWire(torch.bfloat16),
        "int8": Int8Wire,
    }
    return formats[compression]()
