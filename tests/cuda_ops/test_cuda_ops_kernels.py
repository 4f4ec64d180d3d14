"""The Triton kernels (through their launch wrappers, `triton_impl`) against the CPU reference.

On a GPU machine these run on CUDA tensors, compiled. Without one,
test_cuda_ops_interpreter.py runs this file in a child pytest with
TRITON_INTERPRET=1, where they run on CPU tensors (Triton decides when a
kernel is defined whether it is interpreted, so the variable must be set
before Triton is imported and must not leak into other tests).

The kernels must match the reference bit for bit: they do the same fp32
operations in the same order, with IEEE division and no fused multiply-adds.
The one exception is the interpreter's fp32 -> bf16 cast, which truncates
where GPUs and PyTorch round to nearest (1 bf16 ulp).
"""
from __future__ import annotations

import os

import pytest
import torch

from gradsync.cuda_ops import reference as R

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BIG = (1 << 20) + 3 if not INTERPRET else 3 * 4096 + 3
"""Many blocks and a ragged tail: 1M + 3 elements on a GPU; under the interpreter (slow on 1M) four launch
blocks of 4096 (`triton_impl.BLOCK`, `QUANT_TILE`) with the same ragged tail."""

if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip("no GPU: test_cuda_ops_interpreter.py runs these kernels with TRITON_INTERPRET=1",
                allow_module_level=True)
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # NumPy on NaN/Inf under the interpreter
if not INTERPRET:
    pytestmark += [pytest.mark.gpu, pytest.mark.job]  # Triton compiles each kernel with ptxas, a process


@pytest.fixture(scope="module")
def T():
    return pytest.importorskip("gradsync.cuda_ops.triton_impl")


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def dev(tensors):
    return [t.to(DEVICE) for t in tensors]


def check(got: torch.Tensor, ref: torch.Tensor):
    """got (from a kernel) equals ref (from the reference) bit for bit, NaN where NaN; only bf16
    results under the interpreter may differ by 1 ulp (it truncates fp32 -> bf16)."""
    assert got.device.type == DEVICE and got.shape == ref.shape and got.dtype == ref.dtype
    rtol = 2.0**-7 if INTERPRET and ref.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=rtol, atol=0.0, equal_nan=True)


# --- aggregate --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_aggregate(T, dtype, k, n):
    xs = [randn(n, dtype=dtype, seed=i) for i in range(k)]
    check(T.aggregate(dev(xs), 0.3, None), R.aggregate(xs, 0.3, None))
    check(T.aggregate(dev(xs), 1.0, torch.float32), R.aggregate(xs, 1.0, torch.float32))


@pytest.mark.parametrize("dtype,k", [(torch.float32, 3), (torch.bfloat16, 2)])
def test_aggregate_big(T, dtype, k):
    xs = [randn(BIG, dtype=dtype, seed=i) for i in range(k)]
    check(T.aggregate(dev(xs), 0.5, torch.float32), R.aggregate(xs, 0.5, torch.float32))


def test_aggregate_non_contiguous_and_strided_views(T):
    stacked = randn(3, 40, 30, seed=1)
    views = list(stacked[:, ::2, 1::3].to(DEVICE).unbind(0))  # non-contiguous
    ref = R.aggregate(list(stacked[:, ::2, 1::3].unbind(0)), 2.0, None)
    check(T.aggregate(views, 2.0, None), ref)
    rows = list(randn(5, 1001, seed=2).to(DEVICE)[:, 3:1000].unbind(0))  # contiguous rows at odd offsets
    check(T.aggregate(rows, 1.0, None), R.aggregate([r.cpu() for r in rows], 1.0, None))


def test_aggregate_empty_and_non_finite(T):
    assert T.aggregate(dev([torch.empty(0, 3)] * 2), 1.0, None).shape == (0, 3)
    with pytest.raises(ValueError, match="tensors: got an empty list"):
        T.aggregate([], 1.0, None)
    a = torch.tensor([1.0, float("nan"), float("inf"), float("inf"), 2.0])
    b = torch.tensor([1.0, 0.0, 1.0, float("-inf"), float("-inf")])
    got = T.aggregate(dev([a, b]), 1.0, torch.float16).cpu()
    assert got[0] == 2 and got[1].isnan() and got[2] == float("inf") and got[3].isnan()
    assert got[4] == float("-inf")


# --- scaled cast ------------------------------------------------------------------------------

CASTS = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.float16, torch.float32),
         (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]


@pytest.mark.parametrize("src,dst", CASTS)
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_scaled_cast(T, src, dst, n):
    x = randn(n, dtype=src, seed=n, scale=100.0)
    x[0] = float("nan")
    if n > 2:
        x[1], x[2] = float("inf"), float("-inf")
    check(T.scaled_cast(x.to(DEVICE), 0.125, dst), R.scaled_cast(x, 0.125, dst))


def test_scaled_cast_big_non_contiguous_and_empty(T):
    x = randn(BIG, seed=3, scale=1e5)  # overflows fp16 without the scale
    check(T.scaled_cast(x.to(DEVICE), 1 / 8, torch.float16), R.scaled_cast(x, 1 / 8, torch.float16))
    m = randn(30, 20, seed=4)
    check(T.scaled_cast(m.to(DEVICE).t(), 2.0, torch.bfloat16), R.scaled_cast(m.t(), 2.0, torch.bfloat16))
    assert T.scaled_cast(torch.empty(0, device=DEVICE), 1.0, torch.float16).shape == (0,)


# --- int8 -------------------------------------------------------------------------------------

def check_quantized(got, ref, got_res=None, ref_res=None):
    """Same int8 values, scales and updated residual, bit for bit."""
    (q, s), (rq, rs) = got, ref
    assert q.device.type == DEVICE and q.dtype == torch.int8
    assert torch.equal(q.cpu(), rq)
    torch.testing.assert_close(s.cpu(), rs, rtol=0, atol=0, equal_nan=True)
    if got_res is not None:
        assert torch.equal(got_res.cpu(), ref_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 127, 4097])
@pytest.mark.parametrize("block", [8, 64, 8192])
def test_quantize_int8(T, dtype, n, block):
    x = randn(n, dtype=dtype, seed=n + block, scale=3.0)
    check_quantized(T.quantize_int8(x.to(DEVICE), None, block), R.quantize_int8(x, None, block))
    res = randn(n, seed=5, scale=0.01)
    res_dev = res.clone().to(DEVICE)
    ref = R.quantize_int8(x, res, block)
    check_quantized(T.quantize_int8(x.to(DEVICE), res_dev, block), ref, res_dev, res)


def test_quantize_int8_big(T):
    x, res = randn(BIG, seed=6), randn(BIG, seed=7, scale=0.01)
    res_dev = res.clone().to(DEVICE)
    ref = R.quantize_int8(x, res, 256)
    check_quantized(T.quantize_int8(x.to(DEVICE), res_dev, 256), ref, res_dev, res)


def test_quantize_int8_non_finite_zero_empty_and_non_contiguous(T):
    x = randn(100, seed=8)
    x[3], x[40], x[99] = float("nan"), float("inf"), float("-inf")
    x[64:80] = 0.0
    res = torch.full((100,), 0.5)
    res[64:80] = 0.0
    res_dev = res.clone().to(DEVICE)
    ref = R.quantize_int8(x, res, 16)
    got = T.quantize_int8(x.to(DEVICE), res_dev, 16)
    check_quantized(got, ref, res_dev, res)
    assert got[1].cpu()[[0, 2, 6]].isnan().all() and got[1].cpu()[4] == 0  # bad blocks -> NaN, zero block -> 0
    m = randn(40, 30, seed=9)
    check_quantized(T.quantize_int8(m.to(DEVICE).t(), None, 32), R.quantize_int8(m.t(), None, 32))
    q, s = T.quantize_int8(torch.empty(0, device=DEVICE), None, 8)
    assert q.shape == (0,) and s.shape == (0,)
    with pytest.raises(ValueError, match="block_size: got 12"):
        T.quantize_int8(x.to(DEVICE), None, 12)


def test_quantize_int8_tiny_blocks_match_the_reference(T):
    """Blocks below MIN_INT8_AMAX send zeros (127 / amax would overflow to inf and make NaN)."""
    x = torch.zeros(48)
    x[1], x[17], x[33] = 1e-30, 1e-38, 1e-44  # one tiny value in each block of 16
    res = torch.zeros(48)
    res_dev = res.clone().to(DEVICE)
    ref = R.quantize_int8(x, res, 16)
    got = T.quantize_int8(x.to(DEVICE), res_dev, 16)
    check_quantized(got, ref, res_dev, res)
    assert torch.isfinite(res).all() and got[0].cpu()[[17, 33]].eq(0).all()


def compressed(k, n, block, seed=0):
    cs = [R.quantize_int8(randn(n, seed=seed + i, scale=i + 1.0), None, block) for i in range(k)]
    return torch.stack([c[0] for c in cs]), torch.stack([c[1] for c in cs])


@pytest.mark.parametrize("k", [1, 3, 16])
@pytest.mark.parametrize("n", [1, 127, 4097])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_aggregate(T, k, n, out_dtype):
    q, s = compressed(k, n, 64)
    check(T.dequantize_aggregate(q.to(DEVICE), s.to(DEVICE), 64, 1 / k, out_dtype),
          R.dequantize_aggregate(q, s, 64, 1 / k, out_dtype))


def test_dequantize_aggregate_big_strided_rows_and_nan(T):
    q, s = compressed(2, BIG, 1024)
    check(T.dequantize_aggregate(q.to(DEVICE), s.to(DEVICE), 1024, 0.5, torch.float32),
          R.dequantize_aggregate(q, s, 1024, 0.5, torch.float32))
    q, s = compressed(4, 300, 8)
    wide_q = torch.zeros(4, 310, dtype=torch.int8)
    wide_q[:, 5:305] = q
    s[1, 3] = float("nan")
    got = T.dequantize_aggregate(wide_q.to(DEVICE)[:, 5:305], s.to(DEVICE).t().contiguous().t(), 8, 0.25,
                                 torch.float32)
    ref = R.dequantize_aggregate(q, s, 8, 0.25, torch.float32)
    check(got, ref)
    assert got.cpu()[24:32].isnan().all() and not got.cpu()[:24].isnan().any()
    with pytest.raises(ValueError, match=r"scales: expected a torch.float32 tensor of shape \(4, 38\)"):
        T.dequantize_aggregate(q.to(DEVICE), s[:, :-1].to(DEVICE), 8, 1.0, torch.float32)
    assert T.dequantize_aggregate(torch.empty(2, 0, dtype=torch.int8, device=DEVICE),
                                  torch.empty(2, 0, device=DEVICE), 8, 1.0, torch.float32).shape == (0,)
