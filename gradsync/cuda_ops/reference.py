"""CPU implementations of the cuda_ops ops, in plain PyTorch; also the reference.

Every function here is the registered CPU kernel of its op and the ground truth
the Triton kernels are tested against, so each one performs the same fp32
operations in the same order as its kernel (sequential accumulation, scale
applied last, `floor(v * (127 / amax) + 0.5)` rounding). They run on any
device, which lets `bench/cuda_ops.py` time them on a GPU as "the plain
PyTorch way". Inputs are validated with `checks` before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import checks


def _sum_f32(tensors: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    acc = torch.empty(tensors[0].shape, dtype=torch.float32, device=tensors[0].device)
    acc.copy_(tensors[0])
    for t in tensors[1:]:
        acc.add_(t)
    return acc.mul_(scale)


def aggregate(tensors: Sequence[torch.Tensor], scale: float, out_dtype: torch.dtype | None) -> torch.Tensor:
    """Sum of K same-shaped tensors times `scale`, accumulated in fp32, returned in out_dtype."""
    dtype = checks.aggregate_args(tensors, out_dtype)
    return _sum_f32(tensors, scale).to(dtype)


def scaled_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x * scale` computed in fp32 and cast to `dtype`, as a new contiguous tensor."""
    checks.scaled_cast_args(x, dtype)
    return (x.to(torch.float32) * scale).to(dtype, memory_format=torch.contiguous_format)


def quantize_int8(x: torch.Tensor, residual: torch.Tensor | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise int8 quantization of `x + residual`; updates `residual` in place.

    See `compression.compress_int8` for the format and the non-finite rule.
    """
    nb = checks.quantize_int8_args(x, residual, block_size)
    n = x.numel()
    v = x.reshape(-1).to(torch.float32)
    if residual is not None:
        v = v + residual.view(-1)
    vb = F.pad(v, (0, nb * block_size - n)).view(nb, block_size)
    finite = torch.isfinite(vb).all(dim=1)
    amax = vb.abs().amax(dim=1)
    usable = finite & (amax >= checks.MIN_INT8_AMAX)  # below it, 127 / amax overflows: the block sends zeros
    scales = torch.where(finite, amax / 127.0, float("nan"))
    # full_like(...) / t is a true division; 127.0 / t would be reciprocal(t) * 127 (other rounding).
    inv = torch.where(usable, torch.full_like(amax, 127.0) / torch.where(usable, amax, 1.0), 0.0)
    q = torch.floor(vb * inv[:, None] + 0.5).clamp_(-127.0, 127.0)
    q = torch.where(finite[:, None], q, 0.0)
    if residual is not None:
        err = torch.where(finite[:, None], vb - q * scales[:, None], 0.0)
        residual.view(-1).copy_(err.view(-1)[:n])
    payload = q.to(torch.int8).view(-1)[:n].reshape(x.shape).clone()
    return payload, scales


def dequantize_aggregate(
    payloads: torch.Tensor, scales: torch.Tensor, block_size: int, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """`scale * sum_k payloads[k] * scales[k, i // block_size]` in fp32, as a flat out_dtype tensor."""
    checks.dequantize_aggregate_args(payloads, scales, block_size, out_dtype)
    k, n = payloads.shape
    per_elem = scales.repeat_interleave(block_size, dim=1)[:, :n]
    acc = torch.zeros(n, dtype=torch.float32, device=payloads.device)
    for i in range(k):
        acc.add_(payloads[i].to(torch.float32) * per_elem[i])
    return acc.mul_(scale).to(out_dtype)
