"""Triton kernels of the cuda_ops ops (the launch wrappers are in `triton_impl`).

Each kernel fuses into one pass what PyTorch does in several: a K-way sum
with fp32 accumulation and the scale; a scaled cast; blockwise int8
quantization with its scales and the error-feedback update; and the
dequantize-and-sum of K int8 payloads. All arithmetic is fp32 (fp16/bf16 are
only loaded and stored), offsets are int64, and nothing loads a pointer from
memory, so every kernel also runs on CPU tensors under `TRITON_INTERPRET=1`.
Whether a kernel is compiled or interpreted is fixed when this module is
imported, by the `TRITON_INTERPRET` environment variable.
"""

from __future__ import annotations

import triton
import triton.language as tl

MIN_AMAX = tl.constexpr(1e-36)
"""Same as `checks.MIN_INT8_AMAX`: smaller blocks send zeros (127 / amax would overflow)."""

MAX_INPUTS = 16
"""Input pointers one `sum_kernel` launch takes; more inputs chain launches through an fp32 buffer."""


@triton.jit
def _add_input(acc, ptr, offs, mask, I: tl.constexpr, NUM: tl.constexpr):  # noqa: E741 (I: a constexpr index)
    if I < NUM:
        acc += tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def sum_kernel(
    out_ptr,
    acc_ptr,
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    p8,
    p9,
    p10,
    p11,
    p12,
    p13,
    p14,
    p15,
    n,
    scale,
    NUM: tl.constexpr,
    HAS_ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = (acc + p0 + ... + p[NUM-1]) * scale, left to right in fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_ACC:
        acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        acc += tl.load(p0 + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.load(p0 + offs, mask=mask, other=0.0).to(tl.float32)
    acc = _add_input(acc, p1, offs, mask, 1, NUM)
    acc = _add_input(acc, p2, offs, mask, 2, NUM)
    acc = _add_input(acc, p3, offs, mask, 3, NUM)
    acc = _add_input(acc, p4, offs, mask, 4, NUM)
    acc = _add_input(acc, p5, offs, mask, 5, NUM)
    acc = _add_input(acc, p6, offs, mask, 6, NUM)
    acc = _add_input(acc, p7, offs, mask, 7, NUM)
    acc = _add_input(acc, p8, offs, mask, 8, NUM)
    acc = _add_input(acc, p9, offs, mask, 9, NUM)
    acc = _add_input(acc, p10, offs, mask, 10, NUM)
    acc = _add_input(acc, p11, offs, mask, 11, NUM)
    acc = _add_input(acc, p12, offs, mask, 12, NUM)
    acc = _add_input(acc, p13, offs, mask, 13, NUM)
    acc = _add_input(acc, p14, offs, mask, 14, NUM)
    acc = _add_input(acc, p15, offs, mask, 15, NUM)
    tl.store(out_ptr + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scaled_cast_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    """out = cast(float32(x) * scale)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_int8_kernel(
    x_ptr,
    res_ptr,
    q_ptr,
    scales_ptr,
    n,
    num_blocks,
    HAS_RESIDUAL: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """ROWS blocks of BS elements per program: v = x + res; per-block scale = amax / 127,
    q = floor(v * 127 / amax + 0.5); res = v - q * scale. A block holding NaN/Inf gets
    scale NaN, q = 0 and res = 0."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        v += tl.load(res_ptr + offs, mask=mask, other=0.0)
    mag = tl.abs(v)
    nonfinite = tl.sum(tl.where(mag < float("inf"), 0, 1), axis=1)
    finite = nonfinite == 0
    amax = tl.max(tl.where(finite[:, None], mag, 0.0), axis=1)
    usable = finite & (amax >= MIN_AMAX)  # below it, 127 / amax overflows: the block sends zeros
    scale = tl.where(finite, tl.math.div_rn(amax, 127.0), float("nan"))  # IEEE division, as on CPU
    inv = tl.where(usable, tl.math.div_rn(127.0, tl.where(usable, amax, 1.0)), 0.0)
    q = tl.floor(v * inv[:, None] + 0.5)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    q = tl.where(finite[:, None], q, 0.0)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + rows, scale, mask=rows < num_blocks)
    if HAS_RESIDUAL:
        err = tl.where(finite[:, None], v - q * scale[:, None], 0.0)
        tl.store(res_ptr + offs, err, mask=mask)


@triton.jit
def dequantize_sum_kernel(
    q_ptr,
    scales_ptr,
    out_ptr,
    n,
    k,
    q_stride,
    s_stride,
    scale,
    BS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[i] = scale * sum_k float32(q[k, i]) * scales[k, i // BS], k in order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    blk = offs // BS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    qp = q_ptr
    sp = scales_ptr
    i = 0
    while i < k:  # not `range(k)`: Triton 3.6's interpreter cannot index with a runtime argument
        q = tl.load(qp + offs, mask=mask, other=0).to(tl.float32)
        s = tl.load(sp + blk, mask=mask, other=0.0)
        acc += q * s
        qp += q_stride
        sp += s_stride
        i += 1
    tl.store(out_ptr + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)
