"""Gradient aggregation and compression ops: schema + CPU reference + Triton kernels.

Each op is a `torch.library` custom op (`torch.ops.gradsync.*`, registered in
`ops`) with a plain-PyTorch CPU implementation (`reference`), a Triton CUDA
implementation (`triton_impl`, kernels in `triton_kernels`) and a fake
implementation for `torch.compile`; the functions below run the implementation
of the tensors' device (`ops.call`: eager calls skip the dispatcher, and small
CUDA inputs of the cheapest ops take the reference).
"""

from .aggregation import aggregate
from .compression import (
    DEFAULT_BLOCK_SIZE,
    Int8Compressed,
    compress,
    compress_int8,
    decompress,
    decompress_int8,
    dequantize_aggregate,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "Int8Compressed",
    "aggregate",
    "compress",
    "compress_int8",
    "decompress",
    "decompress_int8",
    "dequantize_aggregate",
]
