"""Public gradient compression functions: fp16/bf16 casts and blockwise int8.

fp16/bf16: `compress` fuses the pre-scale (e.g. 1 / world size, which also
keeps the sum of W gradients from overflowing fp16) into the cast;
`decompress` is the scaled cast back.

int8: the flattened gradient is split into blocks of `block_size` elements
(a power of two; the last block may be short). Each block is stored as int8
values q in [-127, 127] plus one fp32 scale s = max|v| / 127, and decodes to
q * s. With error feedback, v = x + residual and the same pass stores
residual = v - q * s, so the quantization error of one round is sent in the
next; summed over rounds, the decoded values differ from the true inputs by
exactly the final residual, at most s / 2 per element. A block that holds a
NaN or Inf gets scale NaN (it decodes to NaN, so the fault is not hidden) and
a zero residual (so it does not poison later rounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import checks, ops
from .aggregation import stacked_count

DEFAULT_BLOCK_SIZE = 256


class Int8Compressed(NamedTuple):
    """One int8-compressed tensor."""

    payload: torch.Tensor
    """int8, the input's shape."""
    scales: torch.Tensor
    """fp32, one per block of the flattened input: shape [ceil(numel / block_size)]."""
    block_size: int
    """Elements per block."""


def compress(x: torch.Tensor, dtype: torch.dtype = torch.float16, scale: float = 1.0) -> torch.Tensor:
    """Scale and cast to a 16-bit float in one pass.

    Args:
        x: fp32, fp16 or bf16 tensor.
        dtype: torch.float16 or torch.bfloat16.
        scale: multiplies x (in fp32) before the cast.

    Returns:
        A new contiguous tensor `(x * scale).to(dtype)`.
    """
    checks.float_dtype("dtype", dtype, checks.HALF_DTYPES)
    return ops.call("scaled_cast", x.device, x, float(scale), dtype)


def decompress(x: torch.Tensor, scale: float = 1.0, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cast a 16-bit float tensor back, times `scale`, in one pass.

    Args:
        x: fp16 or bf16 tensor (as `compress` returns).
        scale: multiplies the values (in fp32).
        out_dtype: dtype of the result.

    Returns:
        A new contiguous tensor `(x.float() * scale).to(out_dtype)`.
    """
    checks.float_dtype("x", x.dtype, checks.HALF_DTYPES)
    return ops.call("scaled_cast", x.device, x, float(scale), out_dtype)


def compress_int8(
    x: torch.Tensor, residual: torch.Tensor | None = None, block_size: int = DEFAULT_BLOCK_SIZE
) -> Int8Compressed:
    """Blockwise int8 quantization, with error feedback when `residual` is given.

    Args:
        x: fp32, fp16 or bf16 tensor.
        residual: optional contiguous fp32 buffer with x's element count (start with zeros,
            keep one per gradient); quantizes `x + residual` and stores the new error in it.
        block_size: elements per scale, a power of two in [8, 8192].

    Returns:
        `Int8Compressed(payload, scales, block_size)`.
    """
    payload, scales = ops.call("quantize_int8", x.device, x, residual, block_size)
    return Int8Compressed(payload, scales, block_size)


def decompress_int8(c: Int8Compressed, scale: float = 1.0, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode one `Int8Compressed`.

    Args:
        c: what `compress_int8` returned.
        scale: multiplies the decoded values.
        out_dtype: dtype of the result.

    Returns:
        `payload * scales[block] * scale` in the payload's shape.
    """
    return dequantize_aggregate([c.payload], [c.scales], c.block_size, scale, out_dtype)


def dequantize_aggregate(
    payloads: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: float | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode K int8-compressed gradients and reduce them in one pass.

    Args:
        payloads: K same-shaped int8 payloads, as a list or stacked [K, ...] (stacked avoids a copy).
        scales: their K scale vectors, as a list or stacked [K, num_blocks].
        block_size: the block size they were compressed with.
        scale: multiplies the sum; default 1 / K, the mean.
        out_dtype: dtype of the result (fp32, bf16 or fp16); accumulation is fp32.

    Returns:
        `scale * sum_k decode(payloads[k], scales[k])` in the payloads' shape.
    """
    empty = "payloads: got an empty list; pass at least one compressed gradient"
    if isinstance(payloads, torch.Tensor):  # stacked: no views of its K rows, they cost more than a small kernel
        k = stacked_count(payloads, "payloads")
        if not k:
            raise ValueError(empty)
        shape = payloads.shape[1:]
        flat_q = payloads.reshape(k, -1)
    else:
        items = list(payloads)
        k = len(items)
        if not k:
            raise ValueError(empty)
        shape = items[0].shape
        for i, p in enumerate(items):
            if p.shape != shape:
                raise ValueError(
                    f"payloads: shape mismatch, payloads[{i}] has shape {tuple(p.shape)} but payloads[0] "
                    f"has {tuple(shape)}; all payloads must have the same shape"
                )
        flat_q = torch.stack([p.reshape(-1) for p in items])
    if isinstance(scales, torch.Tensor):
        flat_s = scales
    else:
        scale_list = list(scales)
        if len(scale_list) != k or any(s.shape != scale_list[0].shape for s in scale_list):
            raise ValueError(
                f"scales: expected {k} same-shaped scale vectors (one per payload), got shapes "
                f"{[tuple(s.shape) for s in scale_list]}; pass the scales compress_int8 returned"
            )
        flat_s = torch.stack(scale_list)
    scale = 1.0 / k if scale is None else float(scale)
    out = ops.call("dequantize_aggregate", flat_q.device, flat_q, flat_s, block_size, scale, out_dtype)
    return out.view(shape)
