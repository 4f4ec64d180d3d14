"""Large CPU tensors on transparent huge pages (Linux), for the fresh buffers the data path fills each step.

A fresh large allocation is a new mapping, and faulting it in 4 KB pages cost
more than the copy that fills it (BENCHMARKS.md, "gRPC against torch RPC"). `empty` asks
the kernel for huge pages (madvise) in the whole 2 MB pages inside a tensor of
`HUGE_PAGE_MIN_BYTES` or more; elsewhere, or when the kernel declines, the
tensor simply has plain pages.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

import torch

HUGE_PAGE_MIN_BYTES = 8 << 20
"""Tensors this large ask for huge pages."""

_HUGE_PAGE = 2 << 20
_madvise: Callable[..., int] | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes, _madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    _MADV_HUGEPAGE = mmap.MADV_HUGEPAGE
except (AttributeError, OSError):  # not Linux, or no madvise: plain pages
    _madvise = None


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, on huge pages when it is large."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if _madvise is not None and nbytes >= HUGE_PAGE_MIN_BYTES:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a failure leaves plain pages
    return out


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A new CPU tensor with `tensor`'s values (any device), on huge pages when it is large."""
    return empty(tuple(tensor.shape), tensor.dtype).copy_(tensor.detach())
