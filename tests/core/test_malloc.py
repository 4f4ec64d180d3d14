"""gradsync.core.malloc: a rank keeps two malloc arenas however many of its threads allocate (glibc), so its heap
stops growing under load (bench/soak.py measures the memory; these tests count arenas, not bytes); a process
holding a dynamic table maps its large blocks (bench/dynamic.py measures the memory; these tests count
mappings; tests/tables/test_dynamic_servers.py: which servers fix the threshold)."""
import ctypes
import os
import platform
import subprocess
import sys
import tempfile
import threading

import pytest

import gradsync
from gradsync.core import malloc

pytestmark = [pytest.mark.job,  # every test here starts processes
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")]

THREADS = 8


def arenas_in_use(threads: int = THREADS) -> int:
    """The arenas of this process after `threads` threads, all alive at once, each allocated (a thread's
    first allocation takes an arena of its own while glibc's limit allows)."""
    barrier = threading.Barrier(threads + 1, timeout=10)

    def allocate():
        block = bytearray(1 << 16)
        barrier.wait()
        barrier.wait()
        del block

    started = [threading.Thread(target=allocate) for _ in range(threads)]
    for t in started:
        t.start()
    barrier.wait()
    try:
        return _count_arenas()
    finally:
        barrier.wait()
        for t in started:
            t.join(timeout=10)


def _count_arenas() -> int:
    libc = ctypes.CDLL(None)
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "malloc_info.xml")
        stream = libc.fopen(path.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        with open(path) as f:
            return f.read().count("<heap nr=")


def _arenas_in_fresh_process(limit: bool, env: dict | None = None) -> tuple[bool, int]:
    code = ("import test_malloc; from gradsync.core import malloc; "
            f"print({'malloc.limit_arenas()' if limit else 'False'}, test_malloc.arenas_in_use())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=os.path.dirname(__file__), env={**os.environ, **(env or {})}).stdout.split()
    return out[0] == "True", int(out[1])


def test_limit_arenas_keeps_two_where_glibc_would_give_each_thread_its_own():
    assert _arenas_in_fresh_process(limit=False, env={"MALLOC_ARENA_MAX": "64"})[1] > malloc.ARENAS
    assert _arenas_in_fresh_process(limit=True) == (True, malloc.ARENAS)


def test_a_users_malloc_arena_max_is_left_alone():
    assert _arenas_in_fresh_process(limit=True, env={"MALLOC_ARENA_MAX": "4"}) == (False, 4)


def arenas_of_a_worker() -> int:
    return arenas_in_use()


def _mapped_after_a_larger_block_was_freed(fix: bool, env: dict | None = None) -> tuple[bool, bool]:
    """In a fresh process: whether a block of twice the fixed threshold is a mapping of its own after one of four
    times it was freed (glibc raises its threshold then, unless it is fixed)."""
    code = ("import ctypes; from gradsync.core import malloc\n"
            "class Info(ctypes.Structure): _fields_ = [(n, ctypes.c_size_t) for n in 'abcdefghij']\n"
            "libc = ctypes.CDLL(None); libc.mallinfo2.restype = Info\n"
            f"fixed = {'malloc.fix_mmap_threshold()' if fix else 'False'}\n"
            "big = bytearray(4 * malloc.MMAP_THRESHOLD); del big\n"
            "before = libc.mallinfo2().d; block = bytearray(2 * malloc.MMAP_THRESHOLD)\n"
            "print(fixed, libc.mallinfo2().d > before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return out[0] == "True", out[1] == "True"


def test_a_fixed_mmap_threshold_maps_large_blocks_after_glibc_would_have_raised_it():
    assert _mapped_after_a_larger_block_was_freed(fix=False) == (False, False)
    assert _mapped_after_a_larger_block_was_freed(fix=True) == (True, True)
    assert _mapped_after_a_larger_block_was_freed(fix=True, env={"MALLOC_MMAP_THRESHOLD_": "65536"}) == (False, True)


@pytest.mark.timeout(60)
def test_every_rank_limits_its_arenas_when_it_joins_the_job(launch):
    assert launch(arenas_of_a_worker, strategy="ps", workers=1, timeout=50) == [malloc.ARENAS]
