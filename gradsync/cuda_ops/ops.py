"""Registration of the `gradsync::*` custom ops with `torch.library`.

One schema per op, the CPU kernel from `reference`, the CUDA kernel from
`triton_impl` (imported on first CUDA call, so Triton stays optional on CPU
machines) and a fake implementation that validates the arguments and
describes the outputs, so the ops trace under `torch.compile`. The public
functions in `aggregation` and `compression` call these ops; the dispatcher
picks the kernel from the inputs' device.
"""
from __future__ import annotations

import importlib

import torch
from torch.library import custom_op

from . import checks, reference


def _triton():
    try:
        return importlib.import_module("gradsync.cuda_ops.triton_impl")
    except ImportError as e:
        raise RuntimeError(
            f"gradsync.cuda_ops: CUDA tensors need Triton ({e}); pip install 'triton>=3.0', "
            f"or pass CPU tensors to use the PyTorch implementation"
        ) from e


@custom_op("gradsync::aggregate", mutates_args=(), device_types="cpu")
def aggregate(tensors: list[torch.Tensor], scale: float, out_dtype: torch.dtype | None) -> torch.Tensor:
    return reference.aggregate(tensors, scale, out_dtype)


@aggregate.register_kernel("cuda")
def _(tensors, scale, out_dtype):
    return _triton().aggregate(tensors, scale, out_dtype)


@aggregate.register_fake
def _(tensors, scale, out_dtype):
    checks.same_inputs("tensors", tensors)
    dtype = out_dtype or tensors[0].dtype
    checks.float_dtype("out_dtype", dtype)
    return tensors[0].new_empty(tensors[0].shape, dtype=dtype)


@custom_op("gradsync::scaled_cast", mutates_args=(), device_types="cpu")
def scaled_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return reference.scaled_cast(x, scale, dtype)


@scaled_cast.register_kernel("cuda")
def _(x, scale, dtype):
    return _triton().scaled_cast(x, scale, dtype)


@scaled_cast.register_fake
def _(x, scale, dtype):
    checks.float_dtype("x", x.dtype)
    checks.float_dtype("dtype", dtype)
    return x.new_empty(x.shape, dtype=dtype)


@custom_op("gradsync::quantize_int8", mutates_args=("residual",), device_types="cpu")
def quantize_int8(
    x: torch.Tensor, residual: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_int8(x, residual, block_size)


@quantize_int8.register_kernel("cuda")
def _(x, residual, block_size):
    return _triton().quantize_int8(x, residual, block_size)


@quantize_int8.register_fake
def _(x, residual, block_size):
    checks.float_dtype("x", x.dtype)
    checks.block_size(block_size)
    if residual is not None:
        checks.residual(residual, x)
    nb = checks.num_blocks(x.numel(), block_size)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((nb,), dtype=torch.float32)


@custom_op("gradsync::dequantize_aggregate", mutates_args=(), device_types="cpu")
def dequantize_aggregate(
    payloads: torch.Tensor, scales: torch.Tensor, block_size: int, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    return reference.dequantize_aggregate(payloads, scales, block_size, scale, out_dtype)


@dequantize_aggregate.register_kernel("cuda")
def _(payloads, scales, block_size, scale, out_dtype):
    return _triton().dequantize_aggregate(payloads, scales, block_size, scale, out_dtype)


@dequantize_aggregate.register_fake
def _(payloads, scales, block_size, scale, out_dtype):
    checks.int8_payloads(payloads, scales, block_size)
    checks.float_dtype("out_dtype", out_dtype)
    return payloads.new_empty((payloads.shape[1],), dtype=out_dtype)
