"""glibc malloc settings: a long-running rank keeps a few arenas, so its heap stops growing under load; a server
holding a dynamic table gives its large blocks back when it frees them, so its RSS follows what it holds.

glibc gives a thread that allocates while another thread holds its arena an arena of its own, up to
8 per core. A rank's RPC, TensorPipe and gloo threads allocate and free each step's tensors (gradients
received, snapshots, replies, a few hundred KB each on a small model: under glibc's mmap threshold once
one larger block was freed) in whichever arena they are attached to, and each arena's heap grows to
the worst mix of those it sees: on a parameter server the memory in use stays flat while the free memory
held in the arenas grows (`malloc_trim(0)` gives it back: fragmentation, not a leak). With two arenas the
RSS is flat (bench/soak.py; BENCHMARKS.md, "Memory under load").

glibc also serves a block of its mmap threshold or more from a mapping of its own, unmapped when freed, but
raises the threshold (up to 32 MB) each time it frees such a block: after that, blocks of a dynamic table's
size (its id index, its recency log, rebuilt from time to time) come from the heap and are kept there when
freed, and the RSS of a server holding the table steps up and down by tens of MB with no change in what it
holds; a fixed threshold keeps it flat (bench/dynamic.py, memory; BENCHMARKS.md, "Dynamic tables: memory, speed
and quality"). Only such servers fix it: above the threshold every block is a fresh mapping, faulted in
page by page, which a process computing the user's model (a worker) would pay on its large temporaries.
"""

from __future__ import annotations

import ctypes
import os

ARENAS = 2
"""Arenas a rank keeps (glibc's default: 8 per core)."""

MMAP_THRESHOLD = 1 << 20
"""The fixed mmap threshold of a server holding a dynamic table: a step's blocks (a batch's ids and rows) stay
below it, a table's (its index, its recency log, its columns) above (1 MB against 4 MB: BENCHMARKS.md,
"Dynamic tables: memory, speed and quality")."""

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt parameters, <malloc.h>


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap this process's malloc arenas at `arenas`, unless the user chose (MALLOC_ARENA_MAX, or
    glibc.malloc.arena_max in GLIBC_TUNABLES) or the C library is not glibc. Call it before the process
    starts its threads: arenas that exist stay. Returns whether the cap was set."""
    chosen = "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", "")
    return not chosen and _mallopt(_M_ARENA_MAX, arenas)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every block of `threshold` bytes or more from a mapping of its own, given back when freed, from now
    on (glibc no longer raises the threshold), unless the user chose (MALLOC_MMAP_THRESHOLD_, or
    glibc.malloc.mmap_threshold in GLIBC_TUNABLES) or the C library is not glibc. Returns whether it was set."""
    chosen = "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")
    return not chosen and _mallopt(_M_MMAP_THRESHOLD, threshold)


def _mallopt(parameter: int, value: int) -> bool:
    """mallopt(parameter, value); False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(parameter, value) == 1
