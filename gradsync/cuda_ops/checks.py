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


def same_inputs(name: str, tensors: Sequence[torch.Tensor], item=None) -> None:
    """Require a non-empty list of same-shape, same-dtype, same-device float tensors.

    `item(i)` names element i in messages (default: `name[i]`).
    """
    item = item or (lambda i: f"{name}[{i}]")
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


def out_tensor(out: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
    """Require `out` to be a contiguous float tensor of `shape` on `device`."""
    if out.shape != shape:
        raise ValueError(
            f"out: shape {tuple(out.shape)} does not match the result shape {tuple(shape)}; "
            f"allocate out with the inputs' shape"
        )
    float_dtype("out", out.dtype)
    if out.device != device:
        raise ValueError(f"out: on {out.device} but the inputs are on {device}; allocate it on {device}")
    if not out.is_contiguous():
        raise ValueError("out: must be contiguous; pass a contiguous tensor (e.g. torch.empty_like)")


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


def bucket_lists(tensors: Sequence[torch.Tensor], num_workers: int) -> int:
    """Validate a worker-major flat bucket list; returns the number of buckets."""
    if num_workers < 1:
        raise ValueError(f"num_workers: got {num_workers}; need at least one worker")
    if len(tensors) == 0 or len(tensors) % num_workers:
        raise ValueError(
            f"per_worker: {len(tensors)} tensors do not split evenly over {num_workers} workers; "
            f"every worker must pass the same, non-empty bucket list"
        )
    buckets = len(tensors) // num_workers
    for b in range(buckets):
        same_inputs("per_worker", tensors[b::buckets], item=lambda w, b=b: f"per_worker[{w}][{b}]")
        if tensors[b].device != tensors[0].device:
            raise ValueError(
                f"per_worker: bucket {b} is on {tensors[b].device} but bucket 0 is on "
                f"{tensors[0].device}; keep all buckets on one device"
            )
    return buckets


def bucket_out_dtype(first_worker: Sequence[torch.Tensor], out_dtype: torch.dtype | None) -> torch.dtype:
    """The one output dtype of a bucket list: `out_dtype`, else the buckets' common dtype."""
    if out_dtype is not None:
        float_dtype("out_dtype", out_dtype)
        return out_dtype
    dtypes = sorted({str(t.dtype) for t in first_worker})
    if len(dtypes) > 1:
        raise TypeError(
            f"per_worker: buckets have different dtypes ({', '.join(dtypes)}) and out_dtype is None; "
            f"pass out_dtype to choose the output dtype"
        )
    return first_worker[0].dtype
