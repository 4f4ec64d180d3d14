"""Registration of the `gradsync::*` custom ops with `torch.library`.

One schema per op (inferred from its CPU kernel's signature), the CPU kernel from
`reference`, the CUDA kernel from `triton_impl` (imported on first CUDA call, so
Triton stays optional on CPU machines) and a fake implementation that validates
the arguments and describes the outputs, so the ops trace under `torch.compile`.
The public functions in `aggregation` and `compression` reach them through
`call`: eager calls go straight to the kernel of the inputs' device, traced
calls through the op.
"""

from __future__ import annotations

import importlib
from typing import Any

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


_OPS: dict[str, Any] = {}


def _register(name: str, fake, mutates_args: tuple[str, ...] = ()):
    """The op `gradsync::<name>`: `reference.<name>` is its schema and CPU kernel, `triton_impl.<name>` its
    CUDA kernel, `fake` (same arguments) its implementation for tracing."""
    op = custom_op(f"gradsync::{name}", getattr(reference, name), mutates_args=mutates_args, device_types="cpu")
    op.register_kernel("cuda")(lambda *args, **kwargs: getattr(_triton(), name)(*args, **kwargs))
    op.register_fake(fake)
    _OPS[name] = op
    return op


SMALL = 2**23
"""Elements below which, on CUDA, `scaled_cast` and a two-input `aggregate` run the reference: its few torch
kernels beat one Triton launch there; the other ops win at every size (`bench/cuda_ops.py --sweep` on an H200:
BENCHMARKS.md, "GPU ops: aggregation and compression")."""


def _reference_is_faster(name: str, args) -> bool:
    if name == "scaled_cast":
        return args[0].numel() < SMALL
    return name == "aggregate" and len(args[0]) <= 2 and args[0][0].numel() < SMALL


def call(name: str, device: torch.device, *args):
    """The op `name` on inputs on `device`. Eager, the kernel is called directly: the dispatcher costs more a call
    than a whole kernel on inputs of a few MB (BENCHMARKS.md, "GPU ops: aggregation and compression"). Under
    `torch.compile`, and on devices the op has no kernel for (its error), through the op."""
    if torch.compiler.is_compiling() or device.type not in ("cpu", "cuda"):
        return _OPS[name](*args)
    if device.type == "cpu" or _reference_is_faster(name, args):
        return getattr(reference, name)(*args)
    return getattr(_triton(), name)(*args)


def _aggregate_fake(tensors, scale, out_dtype):
    return tensors[0].new_empty(tensors[0].shape, dtype=checks.aggregate_args(tensors, out_dtype))


aggregate = _register("aggregate", _aggregate_fake)


def _scaled_cast_fake(x, scale, dtype):
    checks.scaled_cast_args(x, dtype)
    return x.new_empty(x.shape, dtype=dtype)


scaled_cast = _register("scaled_cast", _scaled_cast_fake)


def _quantize_int8_fake(x, residual, block_size):
    blocks = checks.quantize_int8_args(x, residual, block_size)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((blocks,), dtype=torch.float32)


quantize_int8 = _register("quantize_int8", _quantize_int8_fake, mutates_args=("residual",))


def _dequantize_aggregate_fake(payloads, scales, block_size, scale, out_dtype):
    checks.dequantize_aggregate_args(payloads, scales, block_size, out_dtype)
    return payloads.new_empty((payloads.shape[1],), dtype=out_dtype)


dequantize_aggregate = _register("dequantize_aggregate", _dequantize_aggregate_fake)
