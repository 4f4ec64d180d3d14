"""cuda_ops public functions on CPU (the reference path), opcheck, bad input, bench smoke.

Values are checked against closed forms (integer-valued inputs sum exactly
in fp32) or float64 references; the CUDA twins at the end skip without a GPU.
The Triton kernels themselves are checked in test_cuda_ops_kernels.py (run under the
interpreter by test_cuda_ops_interpreter.py) and test_cuda_ops_compile.py.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from gradsync.cuda_ops import (
    aggregate,
    compress,
    compress_int8,
    decompress,
    decompress_int8,
    dequantize_aggregate,
)
from gradsync.cuda_ops import ops
from helpers import ROOT

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cuda(test):
    """Marked `gpu` and `job` (Triton compiles a kernel with ptxas, a process), skipped without a CUDA GPU."""
    return pytest.mark.job(pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU")(test)))


def ints(k: int, n: int, dtype=torch.float32) -> list[torch.Tensor]:
    """K integer-valued tensors: every partial sum is exact in fp32, fp16 and bf16 inputs too."""
    return [((torch.arange(n) * (i + 3)) % 17 - 8 + i).to(dtype) for i in range(k)]


# --- aggregate --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 16, 17])
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_aggregate_is_the_exact_scaled_sum(dtype, k, n):
    xs = ints(k, n, dtype)
    expected = sum(x.double() for x in xs) * 0.25
    out = aggregate(xs, 0.25, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (n,)
    assert torch.equal(out.double(), expected)
    assert torch.equal(aggregate(torch.stack(xs), 0.25, torch.float32), out)


def test_aggregate_keeps_the_placeholder_contract():
    """The parameter server calls aggregate(list of 1-D fp32 CPU tensors, scale=...)."""
    xs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])]
    out = aggregate(xs, scale=0.5)
    assert out.dtype == torch.float32
    assert out.tolist() == [5.5, 11.0, 16.5]
    assert aggregate(torch.stack(xs)).tolist() == [11.0, 22.0, 33.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_aggregate_accumulates_in_fp32_and_rounds_once(dtype):
    # 1 + 16 * tiny: each tiny vanishes when added to 1 in 16-bit, but not in fp32.
    tiny = torch.finfo(dtype).eps / 4
    xs = [torch.ones(5, dtype=dtype)] + [torch.full((5,), tiny, dtype=dtype)] * 16
    out = aggregate(xs, out_dtype=torch.float32)
    assert torch.allclose(out, torch.full((5,), 1 + 16 * tiny, dtype=torch.float32))
    assert aggregate(xs).dtype == dtype
    assert aggregate(xs).tolist() == [float(torch.tensor(1 + 16 * tiny).to(dtype))] * 5


def test_aggregate_keeps_shape_and_reads_non_contiguous_inputs():
    base = [torch.arange(24.0).reshape(4, 6) * (i + 1) for i in range(3)]
    xs = [b.t() for b in base]  # [6, 4], non-contiguous
    out = aggregate(xs, 2.0)
    assert out.shape == (6, 4) and out.is_contiguous()
    assert torch.equal(out, torch.arange(24.0).reshape(4, 6).t() * 12)
    strided = torch.stack(base)[:, ::2, 1::3]  # stacked [3, 2, 2], non-contiguous rows
    assert torch.equal(aggregate(strided), strided.sum(0))


def test_aggregate_empty_tensors_give_empty_results():
    assert aggregate([torch.empty(0), torch.empty(0)]).shape == (0,)
    assert aggregate(torch.empty(3, 0, 5), out_dtype=torch.bfloat16).shape == (0, 5)


def test_aggregate_propagates_nan_and_inf():
    a = torch.tensor([1.0, float("nan"), 1.0, float("inf"), float("inf")])
    b = torch.tensor([1.0, 1.0, float("-inf"), 1.0, float("-inf")])
    out = aggregate([a, b])
    assert out[0] == 2 and out[1].isnan() and out[2] == float("-inf") and out[3] == float("inf")
    assert out[4].isnan()  # inf + -inf


def test_aggregate_fp32_sum_beats_naive_fp16():
    xs = [torch.full((4,), 1000.0, dtype=torch.float16)] * 100  # 1e5 overflows fp16 (max 65504)
    assert torch.equal(aggregate(xs, 1 / 100), torch.full((4,), 1000.0, dtype=torch.float16))


# --- fp16 / bf16 compression ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compress_fuses_the_prescale_and_round_trips(dtype):
    x = torch.linspace(-3, 3, 4097)
    c = compress(x, dtype, scale=0.25)
    assert c.dtype == dtype
    assert torch.equal(c, (x * 0.25).to(dtype))
    back = decompress(c, scale=4.0)
    eps = torch.finfo(dtype).eps  # round to nearest: relative error <= eps / 2
    assert back.dtype == torch.float32
    assert ((back - x).abs() <= x.abs() * eps / 2 + 1e-30).all()


def test_compress_prescale_avoids_fp16_overflow_and_keeps_nan():
    x = torch.tensor([1e5, float("nan"), float("inf"), -1.0])
    c = compress(x, torch.float16, scale=1 / 8)
    assert c[0] == 12500 and c[1].isnan() and c[2] == float("inf") and c[3] == -0.125
    assert compress(x, torch.float16)[0] == float("inf")  # without the scale 1e5 overflows
    assert compress(torch.empty(0, 3)).shape == (0, 3)


# --- int8 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,block", [(1, 8), (127, 32), (4097, 256), (4097, 8192)])
def test_int8_error_is_at_most_half_a_step(n, block):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 5
    c = compress_int8(x, block_size=block)
    nb = -(-n // block)
    assert c.payload.dtype == torch.int8 and c.payload.shape == (n,) and c.scales.shape == (nb,)
    assert c.payload.abs().max() == 127  # each block's largest element maps to +-127
    step = c.scales.repeat_interleave(block)[:n]
    assert torch.allclose(c.scales, torch.nn.functional.pad(x.abs(), (0, nb * block - n)).view(nb, block).amax(1) / 127)
    assert ((decompress_int8(c) - x).abs() <= step * (0.5 + 1e-5)).all()


def test_int8_error_feedback_stays_bounded_over_100_rounds():
    """Bound: with residual r_t = v_t - dec_t and v_t = x_t + r_{t-1}, r_0 = 0,
    sum_t dec_t = sum_t (x_t + r_{t-1} - r_t) = sum_t x_t - r_T, so the accumulated error is
    exactly the final residual, |r_T| <= s_T / 2 per element (s_T = that block's scale),
    up to fp32 rounding of one add and one multiply-subtract per round (< 100 * 4 ulp of |v|)."""
    n, block, rounds = 1000, 64, 100
    g = torch.Generator().manual_seed(0)
    bias = torch.linspace(-0.3, 0.3, n)  # a constant component that plain rounding would keep losing
    residual = torch.zeros(n)
    sum_x = torch.zeros(n, dtype=torch.float64)
    sum_dec = torch.zeros(n, dtype=torch.float64)
    sum_plain = torch.zeros(n, dtype=torch.float64)
    vmax = 0.0
    for _ in range(rounds):
        x = bias + torch.randn(n, generator=g) * 0.01
        vmax = max(vmax, (x + residual).abs().max().item())
        c = compress_int8(x, residual, block)
        sum_x += x.double()
        sum_dec += decompress_int8(c).double()
        sum_plain += decompress_int8(compress_int8(x, block_size=block)).double()
    last_step = c.scales.repeat_interleave(block)[:n].double()
    assert (residual.abs() <= last_step * (0.5 + 1e-5)).all()
    fp32_slack = rounds * 4 * torch.finfo(torch.float32).eps * vmax
    assert torch.allclose(sum_dec, sum_x - residual.double(), rtol=0, atol=fp32_slack)
    drift = (sum_dec - sum_x).abs().max().item()
    assert drift <= last_step.max().item() / 2 + fp32_slack
    # Without error feedback the rounding bias accumulates over the rounds instead.
    assert (sum_plain - sum_x).abs().max().item() > 10 * drift


def test_int8_non_finite_block_decodes_to_nan_and_does_not_poison_the_residual():
    x = torch.ones(32)
    x[3] = float("nan")
    x[20] = float("inf")
    residual = torch.full((32,), 0.001)
    c = compress_int8(x, residual, block_size=16)
    out = decompress_int8(c)
    assert out.isnan().all()  # both blocks hold a non-finite value: nothing silently vanishes
    assert torch.equal(residual, torch.zeros(32))
    c = compress_int8(torch.ones(32), residual, block_size=16)
    assert torch.equal(decompress_int8(c), torch.ones(32))


def test_int8_zero_and_empty_inputs():
    c = compress_int8(torch.zeros(10), torch.zeros(10), block_size=8)
    assert c.scales.tolist() == [0.0, 0.0] and torch.equal(decompress_int8(c), torch.zeros(10))
    e = compress_int8(torch.empty(0))
    assert e.payload.shape == (0,) and e.scales.shape == (0,)
    assert decompress_int8(e).shape == (0,)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_aggregate_is_the_mean_of_the_decoded_inputs(out_dtype):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 43, generator=g) * (k + 1) for k in range(5)]
    cs = [compress_int8(x, block_size=16) for x in xs]
    mean = dequantize_aggregate([c.payload for c in cs], [c.scales for c in cs], 16, out_dtype=out_dtype)
    expected = sum(decompress_int8(c).double() for c in cs) / 5
    assert mean.shape == (3, 43) and mean.dtype == out_dtype
    torch.testing.assert_close(mean.double(), expected, rtol=torch.finfo(out_dtype).eps, atol=1e-6)
    stacked = dequantize_aggregate(torch.stack([c.payload for c in cs]), torch.stack([c.scales for c in cs]), 16,
                                   scale=1.0, out_dtype=out_dtype)
    torch.testing.assert_close(stacked.double(), expected * 5, rtol=torch.finfo(out_dtype).eps, atol=1e-5)


# --- bad input --------------------------------------------------------------------------------

BAD = [
    (lambda: aggregate([torch.ones(3), torch.ones(4)]), ValueError, r"tensors: shape mismatch, tensors\[1\]"),
    (lambda: aggregate([torch.ones(3), torch.ones(3).half()]), TypeError, r"tensors: dtype mismatch, tensors\[1\]"),
    (lambda: aggregate([]), ValueError, "tensors: got an empty list"),
    (lambda: aggregate(torch.ones(())), ValueError, "tensors: a stacked input"),
    (lambda: aggregate([torch.ones(3, dtype=torch.int32)]), TypeError, r"tensors\[0\]: dtype torch.int32"),
    (lambda: aggregate([torch.ones(3)], out_dtype=torch.int8), TypeError, "out_dtype: dtype torch.int8"),
    (lambda: compress(torch.ones(3), torch.float32), TypeError, "dtype: dtype torch.float32"),
    (lambda: decompress(torch.ones(3)), TypeError, "x: dtype torch.float32"),
    (lambda: compress_int8(torch.ones(3), block_size=100), ValueError, "block_size: got 100"),
    (lambda: compress_int8(torch.ones(3), block_size=4), ValueError, "block_size: got 4"),
    (lambda: compress_int8(torch.ones(3), block_size=16384), ValueError, "block_size: got 16384"),
    (lambda: compress_int8(torch.ones(3), torch.zeros(4)), ValueError, "residual: has 4 elements"),
    (lambda: compress_int8(torch.ones(3), torch.zeros(3).double()), TypeError, "residual: dtype torch.float64"),
    (lambda: compress_int8(torch.ones(3, dtype=torch.int64)), TypeError, "x: dtype torch.int64"),
    (lambda: dequantize_aggregate([torch.ones(3, dtype=torch.int8)], [torch.ones(2)], 8), ValueError,
     r"scales: expected a torch.float32 tensor of shape \(1, 1\)"),
    (lambda: dequantize_aggregate([torch.ones(3)], [torch.ones(1)], 8), TypeError, "payloads: expected a 2-D"),
    (lambda: dequantize_aggregate([torch.ones(3, dtype=torch.int8), torch.ones(4, dtype=torch.int8)],
                                  [torch.ones(1)] * 2, 8), ValueError, r"payloads: shape mismatch, payloads\[1\]"),
    (lambda: dequantize_aggregate([torch.ones(3, dtype=torch.int8)] * 2, [torch.ones(1)], 8), ValueError,
     "scales: expected 2 same-shaped"),
    (lambda: dequantize_aggregate([torch.ones(3, dtype=torch.int8)], [torch.ones(1)], 6), ValueError,
     "block_size: got 6"),
]


@pytest.mark.parametrize("call,exc,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_gets_a_clear_error(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_bad_input_changes_nothing():
    residual = torch.full((3,), 0.5)
    with pytest.raises(ValueError):
        compress_int8(torch.ones(3), residual, block_size=12)
    assert torch.equal(residual, torch.full((3,), 0.5))


# --- registration -----------------------------------------------------------------------------

def _opcheck_cases():
    x = torch.randn(37)
    xh = torch.randn(2, 19).half()
    c = [compress_int8(torch.randn(37) * k, block_size=8) for k in (1, 2, 3)]
    payloads, scales = torch.stack([i.payload for i in c]), torch.stack([i.scales for i in c])
    return [
        (ops.aggregate, ([x, x * 2, x * 3], 0.5, None)),
        (ops.aggregate, ([xh, xh], 1.0, torch.float32)),
        (ops.scaled_cast, (x, 0.5, torch.bfloat16)),
        (ops.scaled_cast, (xh, 2.0, torch.float32)),
        (ops.quantize_int8, (x, torch.zeros(37), 8)),
        (ops.quantize_int8, (xh, None, 16)),
        (ops.dequantize_aggregate, (payloads, scales, 8, 1 / 3, torch.float32)),
        (ops.dequantize_aggregate, (payloads, scales, 8, 1.0, torch.bfloat16)),
    ]


def test_opcheck():
    for op, args in _opcheck_cases():
        torch.library.opcheck(op, args)


def test_eager_calls_skip_the_dispatcher(monkeypatch):
    def through_the_op(*args):
        raise AssertionError("an eager call went through the op")

    monkeypatch.setitem(ops._OPS, "aggregate", through_the_op)
    x = torch.randn(10)
    assert torch.equal(aggregate([x, x], 0.5), x)


def test_small_cuda_inputs_of_the_cheapest_ops_take_the_reference():
    small, large = torch.empty(ops.SMALL - 1, device="meta"), torch.empty(ops.SMALL, device="meta")
    assert ops._reference_is_faster("scaled_cast", (small, 1.0, torch.float16))
    assert not ops._reference_is_faster("scaled_cast", (large, 1.0, torch.float16))
    assert ops._reference_is_faster("aggregate", ([small, small], 1.0, None))
    assert not ops._reference_is_faster("aggregate", ([small] * 3, 1.0, None))  # K > 2: Triton wins at any size
    assert not ops._reference_is_faster("aggregate", ([large, large], 1.0, None))
    assert not ops._reference_is_faster("quantize_int8", (small, None, 256))


def test_ops_trace_under_torch_compile():
    def step(grads, residual):
        total = aggregate(grads, 0.5)
        c = compress_int8(total, residual, 8)
        return dequantize_aggregate(c.payload[None], c.scales[None], 8, scale=1.0)

    grads = [torch.randn(40) for _ in range(3)]
    eager_res, compiled_res = torch.zeros(40), torch.zeros(40)
    eager = step(grads, eager_res)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(grads, compiled_res)
    assert torch.equal(compiled, eager) and torch.equal(compiled_res, eager_res)


# --- bench script -----------------------------------------------------------------------------

def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_cuda_ops", pathlib.Path(ROOT, "bench", "cuda_ops.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_smoke_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    _bench_module().main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {r["op"] for r in rows} >= {"aggregate", "compress_fp16", "compress_int8",
                                       "dequantize_aggregate"}
    assert all(r["ms"] > 0 and r["baseline_ms"] > 0 for r in rows)
    assert "| op |" in capsys.readouterr().out


def test_bench_sweep_smoke_reports_each_op_against_its_reference(tmp_path, capsys):
    out = tmp_path / "s.json"
    _bench_module().main(["--smoke", "--sweep", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {r["op"] for r in report["sweep"]} == set(report["reference_wins_up_to"]) == {
        "aggregate", "scaled_cast", "quantize_int8", "dequantize_aggregate"}
    assert all(r["ms"] > 0 and r["reference_ms"] > 0 for r in report["sweep"])
    assert "reference wins up to" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_bench_without_cuda_exits_with_a_message():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _bench_module().main([])


# --- CUDA twins: the public functions dispatch to the Triton kernels ------------------------------

@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_aggregate_matches_cpu(dtype):
    xs = ints(5, 4097, dtype)
    got = aggregate([x.cuda() for x in xs], 0.25, torch.float32)
    assert got.is_cuda and torch.equal(got.cpu(), aggregate(xs, 0.25, torch.float32))


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_compress_matches_cpu(dtype):
    x = torch.randn(4097)
    assert torch.equal(compress(x.cuda(), dtype, 0.5).cpu(), compress(x, dtype, 0.5))
    c = compress(x, dtype)
    assert torch.equal(decompress(c.cuda(), 2.0).cpu(), decompress(c, 2.0))


@cuda
def test_cuda_int8_matches_cpu():
    x = torch.randn(4097) * 3
    res_cpu, res_gpu = torch.full((4097,), 0.01), torch.full((4097,), 0.01, device="cuda")
    cc, cg = compress_int8(x, res_cpu, 64), compress_int8(x.cuda(), res_gpu, 64)
    assert torch.equal(cg.payload.cpu(), cc.payload) and torch.equal(cg.scales.cpu(), cc.scales)
    assert torch.equal(res_gpu.cpu(), res_cpu)
    mean_gpu = dequantize_aggregate([cc.payload.cuda()] * 3, [cc.scales.cuda()] * 3, 64)
    assert torch.equal(mean_gpu.cpu(), dequantize_aggregate([cc.payload] * 3, [cc.scales] * 3, 64))


@pytest.mark.parametrize("magnitude", [1e-30, 1e-38, 1e-44])
def test_int8_tiny_blocks_stay_finite_and_keep_their_value_in_the_residual(magnitude):
    """127 / amax overflows fp32 for amax below ~3.7e-37: such blocks must send zeros, not NaN."""
    x = torch.zeros(300)
    x[3] = magnitude
    residual = torch.zeros(300)
    c = compress_int8(x, residual=residual, block_size=256)
    out = decompress_int8(c)
    assert torch.isfinite(out).all() and torch.isfinite(residual).all()
    assert (out + residual)[3].item() == pytest.approx(magnitude, rel=1e-2)
