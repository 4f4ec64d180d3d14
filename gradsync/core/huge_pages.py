"""Large tensors backed by 2 MB pages where the kernel allows: a dynamic table's id index, columns and recency
logs are tens of MB read at random, and on 4 KB pages nearly every probe misses the TLB too (cold probes of an
index: bench/dynamic_index.py, "pages"). Linux's transparent huge pages in `madvise` or `always` mode;
elsewhere, or where the kernel refuses, a plain tensor."""

from __future__ import annotations

import ctypes

import torch

HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14  # <sys/mman.h>


def empty(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor; when it spans two huge pages or more, the huge pages inside it are asked for
    before anything touches it (a page gets its size when first touched)."""
    tensor = torch.empty(size, dtype=dtype)
    if tensor.nbytes >= 2 * HUGE_PAGE:
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (tensor.data_ptr() + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start and _madvise is not None:
            _madvise(start, end - start, _MADV_HUGEPAGE)
    return tensor


def _libc_madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_madvise = _libc_madvise()
