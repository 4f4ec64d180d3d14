"""The Triton kernels compile for NVIDIA GPUs (sm_80, sm_90) on a machine without one.

The interpreter run (test_cuda_ops_interpreter.py) checks what the kernels
compute; this checks that the real compiler accepts them (constexpr
branches, dtypes, IEEE division, the int8 casts), down to a cubin, for each
specialization the launchers use.
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles kernels: run without TRITON_INTERPRET", allow_module_level=True)
triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gradsync.cuda_ops import triton_kernels as K  # noqa: E402

pytestmark = pytest.mark.job  # every test here starts processes

PTRS = {f"p{i}": "*bf16" for i in range(K.MAX_INPUTS)}
KERNELS = {
    "sum": (K.sum_kernel, {"out_ptr": "*fp16", "acc_ptr": "*fp32", **PTRS, "n": "i64", "scale": "fp32",
                           "NUM": "constexpr", "HAS_ACC": "constexpr", "BLOCK": "constexpr"},
            {"NUM": K.MAX_INPUTS, "HAS_ACC": True, "BLOCK": 4096}),
    "sum_first": (K.sum_kernel, {"out_ptr": "*fp32", "acc_ptr": "*fp32", **PTRS, "n": "i32", "scale": "fp32",
                                 "NUM": "constexpr", "HAS_ACC": "constexpr", "BLOCK": "constexpr"},
                  {"NUM": 3, "HAS_ACC": False, "BLOCK": 4096}),
    "scaled_cast": (K.scaled_cast_kernel, {"x_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "scale": "fp32",
                                           "BLOCK": "constexpr"}, {"BLOCK": 4096}),
    "quantize": (K.quantize_int8_kernel, {"x_ptr": "*bf16", "res_ptr": "*fp32", "q_ptr": "*i8",
                                          "scales_ptr": "*fp32", "n": "i32", "num_blocks": "i32",
                                          "HAS_RESIDUAL": "constexpr", "BS": "constexpr", "ROWS": "constexpr"},
                 {"HAS_RESIDUAL": True, "BS": 256, "ROWS": 16}),
    "dequantize_sum": (K.dequantize_sum_kernel, {"q_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": "*bf16",
                                                 "n": "i64", "k": "i32", "q_stride": "i64", "s_stride": "i32",
                                                 "scale": "fp32", "BS": "constexpr", "BLOCK": "constexpr"},
                       {"BS": 256, "BLOCK": 4096}),
}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_to_a_cubin(name, arch):
    fn, signature, constexprs = KERNELS[name]
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": 8, "enable_fp_fusion": False})
    assert len(compiled.asm["cubin"]) > 0
    ptx = compiled.asm["ptx"]
    assert "fma.rn.f32" not in ptx  # rounds like the reference: no fused multiply-adds
    if name == "quantize":
        assert "div.rn.f32" in ptx  # IEEE division, as on CPU
