"""Launch wrappers for the Triton kernels: the CUDA implementations of the ops.

Each function takes the same arguments as its counterpart in `reference`,
validates them with `checks`, allocates the outputs and launches kernels from
`triton_kernels`. They are the registered CUDA kernels of the ops, and with
`TRITON_INTERPRET=1` set before Triton is imported they also run on CPU
tensors, which is how the tests check them against the reference on a machine
without a GPU.

Non-contiguous inputs are copied to contiguous ones first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton

from . import checks
from . import triton_kernels as K

BLOCK = 4096
NUM_WARPS = 8
EXACT = {"enable_fp_fusion": False}
"""No fused multiply-adds: the kernels round exactly as the reference does."""
QUANT_TILE = 4096
"""Elements one quantization program handles: QUANT_TILE // block_size blocks (at least one)."""


def _on(device: torch.device):
    """Launch on the tensors' GPU, not the current one (a no-op for CPU tensors, interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _launch_sum(xs: Sequence[torch.Tensor], scale: float, out: torch.Tensor) -> None:
    """out (contiguous, numel n) = (xs[0] + ... + xs[K-1]) * scale; xs contiguous, numel n each.

    Launches ceil(K / MAX_INPUTS) kernels; all but the last write the partial fp32 sum into
    `out` (when it is fp32) or a temporary, and the next launch continues from it.
    """
    n = out.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    acc = out if out.dtype == torch.float32 or len(xs) <= K.MAX_INPUTS else None
    if acc is None:
        acc = torch.empty(n, dtype=torch.float32, device=out.device)
    with _on(out.device):
        for start in range(0, len(xs), K.MAX_INPUTS):
            group = list(xs[start : start + K.MAX_INPUTS])
            last = start + K.MAX_INPUTS >= len(xs)
            ptrs = group + [group[0]] * (K.MAX_INPUTS - len(group))
            K.sum_kernel[grid](
                out if last else acc,
                acc,
                *ptrs,
                n,
                scale if last else 1.0,
                NUM=len(group),
                HAS_ACC=start > 0,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
                **EXACT,
            )


def aggregate(tensors: Sequence[torch.Tensor], scale: float, out_dtype: torch.dtype | None) -> torch.Tensor:
    """Triton `aggregate`; same contract as `reference.aggregate`."""
    dtype = checks.aggregate_args(tensors, out_dtype)
    out = torch.empty(tensors[0].shape, dtype=dtype, device=tensors[0].device)
    _launch_sum([_dense(t) for t in tensors], scale, out)
    return out


def scaled_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Triton `scaled_cast`; same contract as `reference.scaled_cast`."""
    checks.scaled_cast_args(x, dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    if n:
        with _on(x.device):
            K.scaled_cast_kernel[(triton.cdiv(n, BLOCK),)](
                _dense(x), out, n, scale, BLOCK=BLOCK, num_warps=NUM_WARPS, **EXACT
            )
    return out


def quantize_int8(x: torch.Tensor, residual: torch.Tensor | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `quantize_int8`; same contract as `reference.quantize_int8`."""
    nb = checks.quantize_int8_args(x, residual, block_size)
    n = x.numel()
    payload = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n:
        x = _dense(x)
        rows = max(1, QUANT_TILE // block_size)
        with _on(x.device):
            K.quantize_int8_kernel[(triton.cdiv(nb, rows),)](
                x,
                residual if residual is not None else x,
                payload,
                scales,
                n,
                nb,
                HAS_RESIDUAL=residual is not None,
                BS=block_size,
                ROWS=rows,
                num_warps=max(1, min(NUM_WARPS, rows * block_size // 256)),
                **EXACT,
            )
    return payload, scales


def dequantize_aggregate(
    payloads: torch.Tensor, scales: torch.Tensor, block_size: int, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """Triton `dequantize_aggregate`; same contract as `reference.dequantize_aggregate`."""
    checks.dequantize_aggregate_args(payloads, scales, block_size, out_dtype)
    k, n = payloads.shape
    out = torch.empty(n, dtype=out_dtype, device=payloads.device)
    if n:
        q = payloads if payloads.stride(1) == 1 else payloads.contiguous()
        s = scales if scales.stride(1) == 1 else scales.contiguous()
        with _on(out.device):
            K.dequantize_sum_kernel[(triton.cdiv(n, BLOCK),)](
                q,
                s,
                out,
                n,
                k,
                q.stride(0),
                s.stride(0),
                scale,
                BS=block_size,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
                **EXACT,
            )
    return out
