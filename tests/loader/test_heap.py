"""release_free_heap hands freed C-heap pages back to the OS (glibc), and is a no-op elsewhere."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import psutil
import pytest

from tidal.loader.heap import release_free_heap


def test_release_is_safe_to_call() -> None:
    assert release_free_heap() in (True, False)
    assert release_free_heap() in (True, False)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_small_chunks_leave_the_resident_set() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    n, size = 100_000, 1024  # ~100 MB in chunks below the mmap threshold: they live in the heap
    chunks = [libc.malloc(size) for _ in range(n)]
    for c in chunks:
        libc.memset(c, 1, size)  # resident
    keep = libc.malloc(size)  # allocated above them, so free() cannot shrink the heap's top
    proc = psutil.Process()
    for c in chunks:
        libc.free(c)
    before = proc.memory_full_info().uss
    assert release_free_heap()
    after = proc.memory_full_info().uss
    libc.free(keep)
    # glibc kept the freed ~100 MB resident; malloc_trim(0) returns nearly all of it.
    assert before - after > n * size // 2, (before, after)
