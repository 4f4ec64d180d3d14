"""Input validation shared by every implementation of the cuda_ops ops.

The CPU reference, the Triton launchers and the fake (meta) implementations
all call these checks, so a bad argument gets the same error on every device
and under `torch.compile`, before any output is written. Each message names
the argument, the bad value and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 8192
MIN_INT8_AMAX = 1e-36
"""Smallest block magnitude int8 quantizes; 127 / amax stays finite in fp32 above it."""


def _names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def float_dtype(name: str, dtype: torch.dtype, allowed=FLOAT_DTYPES) -> None:
    """Reject `dtype` unless it is one of `allowed`."""
    if dtype not in allowed:
        raise TypeError(f"{name}: dtype {dtype} is not supported; use one of {_names(allowed)}")


def same_inputs(name: str, tensors: Sequence[torch.Tensor]) -> None:
    """Require a non-empty list of same-shape, same-dtype, same-device float tensors."""

    def item(i: int) -> str:
        return f"{name}[{i}]"

    if len(tensors) == 0:
        raise ValueError(f"{name}: got an empty list; pass at least one tensor")
    first = tensors[0]
    float_dtype(item(0), first.dtype)
    for i, t in enumerate(tensors[1:], start=1):
        if t.shape != first.shape:
            raise ValueError(
                f"{name}: shape mismatch, {item(i)} has shape {tuple(t.shape)} but {item(0)} has "
                f"{tuple(first.shape)}; all inputs must have the same shape"
            )
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name}: dtype mismatch, {item(i)} is {t.dtype} but {item(0)} is {first.dtype}; "
                f"cast them to one dtype first"
            )
        if t.device != first.device:
            raise ValueError(
                f"{name}: device mismatch, {item(i)} is on {t.device} but {item(0)} is on "
                f"{first.device}; move them to one device first"
            )


def block_size(value: int) -> None:
    """Require a power of two in [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]."""
    ok = isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
    if ok:
        v = int(value)
        ok = MIN_BLOCK_SIZE <= v <= MAX_BLOCK_SIZE and v & (v - 1) == 0
    if not ok:
        raise ValueError(
            f"block_size: got {value!r}; it must be a power of two between {MIN_BLOCK_SIZE} "
            f"and {MAX_BLOCK_SIZE} (e.g. 256)"
        )


def num_blocks(numel: int, block: int) -> int:
    """Number of quantization blocks covering `numel` elements."""
    return -(-numel // block)


def residual(res: torch.Tensor, x: torch.Tensor) -> None:
    """Require an error-feedback buffer: contiguous fp32 with x's element count, on x's device."""
    if res.dtype != torch.float32:
        raise TypeError(f"residual: dtype {res.dtype}; the error-feedback buffer must be torch.float32")
    if res.numel() != x.numel():
        raise ValueError(
            f"residual: has {res.numel()} elements but x has {x.numel()}; "
            f"use torch.zeros(x.numel(), dtype=torch.float32) per gradient"
        )
    if res.device != x.device:
        raise ValueError(f"residual: on {res.device} but x is on {x.device}; keep it on x's device")
    if not res.is_contiguous():
        raise ValueError("residual: must be contiguous (it is updated in place); pass a contiguous buffer")


def int8_payloads(payloads: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Require [K, N] int8 payloads and [K, ceil(N / block)] fp32 scales on one device."""
    block_size(block)
    if payloads.dtype != torch.int8 or payloads.dim() != 2:
        raise TypeError(
            f"payloads: expected a 2-D [K, N] torch.int8 tensor, got {payloads.dtype} with shape "
            f"{tuple(payloads.shape)}; stack the compressed payloads"
        )
    if payloads.shape[0] == 0:
        raise ValueError("payloads: K = 0; pass at least one compressed gradient")
    expected = (payloads.shape[0], num_blocks(payloads.shape[1], block))
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected:
        raise ValueError(
            f"scales: expected a torch.float32 tensor of shape {expected} for payloads of shape "
            f"{tuple(payloads.shape)} and block_size={block}, got {scales.dtype} {tuple(scales.shape)}; "
            f"pass the scales compress_int8 returned with the same block_size"
        )
    if scales.device != payloads.device:
        raise ValueError(f"scales: on {scales.device} but payloads are on {payloads.device}")


def aggregate_args(tensors: Sequence[torch.Tensor], out_dtype: torch.dtype | None) -> torch.dtype:
    """`aggregate`'s arguments; returns the output dtype (out_dtype, else the inputs')."""
    same_inputs("tensors", tensors)
    dtype = out_dtype or tensors[0].dtype
    float_dtype("out_dtype", dtype)
    return dtype


def scaled_cast_args(x: torch.Tensor, dtype: torch.dtype) -> None:
    """`scaled_cast`'s arguments."""
    float_dtype("x", x.dtype)
    float_dtype("dtype", dtype)


def quantize_int8_args(x: torch.Tensor, res: torch.Tensor | None, block: int) -> int:
    """`quantize_int8`'s arguments; returns the number of blocks (of scales)."""
    float_dtype("x", x.dtype)
    block_size(block)
    if res is not None:
        residual(res, x)
    return num_blocks(x.numel(), block)


def dequantize_aggregate_args(payloads: torch.Tensor, scales: torch.Tensor, block: int, out_dtype: torch.dtype) -> None:
    """`dequantize_aggregate`'s arguments."""
    int8_payloads(payloads, scales, block)
    float_dtype("out_dtype", out_dtype)
