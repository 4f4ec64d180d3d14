"""glibc malloc settings for a long-running rank: a few arenas, so its heap stops growing under load.

glibc gives a thread that allocates while another thread holds its arena an arena of its own, up to
8 per core. A rank's RPC, TensorPipe and gloo threads allocate and free each step's tensors (gradients
received, snapshots, replies, a few hundred KB each on a small model: under glibc's mmap threshold once
one larger block was freed) in whichever arena they are attached to, and each arena's heap grows to
the worst mix of those it sees: on a parameter server the memory in use stays flat while the free memory
held in the arenas grows (`malloc_trim(0)` gives it back: fragmentation, not a leak). With two arenas the
RSS is flat (bench/soak.py; BENCHMARKS.md, "Memory under load").
"""
from __future__ import annotations

import ctypes
import os

ARENAS = 2
"""Arenas a rank keeps (glibc's default: 8 per core)."""

_M_ARENA_MAX = -8  # mallopt parameter, <malloc.h>


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap this process's malloc arenas at `arenas`, unless the user chose (MALLOC_ARENA_MAX, or
    glibc.malloc.arena_max in GLIBC_TUNABLES) or the C library is not glibc. Call it before the process
    starts its threads: arenas that exist stay. Returns whether the cap was set."""
    if "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_ARENA_MAX, arenas) == 1
