"""Large weight tensors moved into memory backed by transparent huge pages, after the engine is ready.

A GGUF's blocks are memory-mapped from the file, in 4 KiB pages. A kernel that streams a large
matrix once per step (the bundled model's 178 MB Q8_0 LM head, read whole for every decoded
token) then takes a TLB miss every 4 KiB; backed by 2 MiB pages it takes one every 2 MiB. On a
Zen 4 the LM head's one-row product ran 1.13-1.15x faster that way (same bits; see
benchmarks/README.md). So a tensor of at least RESIDENT_MIN_BYTES, where the kernel's
transparent huge pages are on ("always" or "madvise"), is mapped by `map_resident` at a
huge-page-aligned address, and `promote_resident` later moves it into anonymous memory advised
MADV_HUGEPAGE at the SAME address: it copies the bytes into a fresh mapping, then mremap(2)
puts that mapping over the file's in one call. Nothing that holds a pointer (the kernels'
cached arguments) sees a change but the page size; a thread reading the matrix meanwhile
reads the same bytes from either mapping. Smaller tensors, and every tensor where huge pages
are off, stay plain mappings.

Why later and not at load: assembling 2 MiB pages costs the kernel ~0.25 s in a fresh process
(compaction and zeroing on first touch), which sat on the restart's kill-to-ready path. The
engine process promotes after it reports ready, in a thread at the lowest CPU priority
(tidal/engine/process.py); `tidal.LLM` after it builds its engine. Until then the matrix is
read through the page cache like any other.

Memory: after the move the file's pages are no longer mapped (they stay in the page cache as
cache, not in the process's RSS); a second process on the same file holds its own copy of these
tensors, where the mapping shared the page cache between them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Only tensors this large: the bundled model's LM head (178 MB); a smaller one would round up to
# whole huge pages for little gain.
RESIDENT_MIN_BYTES = 32 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Linux's values (mremap(2), mmap(2)); the stdlib's mmap module names neither
_MAP_FIXED = 0x10
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value
_CHUNK = 16 << 20  # bytes copied and moved at a time (a multiple of HUGE_PAGE_BYTES)


def huge_pages_available() -> bool:
    """Whether MADV_HUGEPAGE can back anonymous memory here (THP "always" or "madvise")."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def wants_resident(nbytes: int) -> bool:
    return nbytes >= RESIDENT_MIN_BYTES and huge_pages_available()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _address_of(mapping: mmap.mmap) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()


def _reserve(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with room for `nbytes` from a huge-page boundary (`start` into it).
    Private: a shared anonymous mapping is shmem, whose huge pages are another setting."""
    holder = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return holder, -_address_of(holder) % HUGE_PAGE_BYTES


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]  # fmt: skip
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _os_error(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")


@dataclass
class _Region:
    """File bytes mapped at `address` (huge-page aligned, `length` bytes, a multiple of
    HUGE_PAGE_BYTES) inside `holder`, an anonymous mapping that owns the address range: its
    munmap when the last tensor over it goes takes whatever is mapped there then."""

    holder: weakref.ref[mmap.mmap]
    address: int
    length: int
    file_bytes: int  # the file's pages mapped from `address`; the rest is untouched zeroes


_PENDING: list[_Region] = []  # mapped, not yet promoted
_LOCK = threading.Lock()  # one promotion at a time; map_resident appends under it
_promoter: threading.Thread | None = None  # the latest promote_in_background thread


def _own(mapping: mmap.mmap, start: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of `mapping` from `start` as a uint8 tensor that keeps the mapping alive."""
    t = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
    _RESIDENT.add(t.untyped_storage().data_ptr())
    return t


# The storages map_resident and resident_copy made (their start addresses; never forgotten: a
# stale entry only makes slice_blocks copy where it could have viewed)
_RESIDENT: set[int] = set()


def is_resident(t: torch.Tensor) -> bool:
    """Whether t (or the tensor it views) is memory made here, not a view of the loader's
    mapping of the whole file."""
    return t.untyped_storage().data_ptr() in _RESIDENT


def map_resident(path: str | Path, offset: int, nbytes: int) -> torch.Tensor:
    """The file's bytes [offset, offset + nbytes) as a uint8 tensor, mapped (private,
    copy-on-write) from a huge-page-aligned address so that `promote_resident` can later move
    them into huge pages in place. The tensor keeps the mapping alive."""
    if nbytes <= 0:
        raise ValueError(f"nbytes {nbytes} must be positive")
    page = mmap.PAGESIZE
    lead = offset % page  # the tensor's start within its first file page
    file_bytes = _round_up(lead + nbytes, page)
    length = _round_up(file_bytes, HUGE_PAGE_BYTES)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < offset + nbytes:  # a mapping past the end would fault with SIGBUS on reading
            raise OSError(f"{path}: {offset + nbytes - size} bytes short at offset {size}")
        holder, start = _reserve(length)  # the range; the file goes over its aligned part
        address = _address_of(holder) + start
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_PRIVATE | _MAP_FIXED
        got = _libc().mmap(address, file_bytes, prot, flags, fd, offset - lead)
        if got != address:
            holder.close()
            raise _os_error(f"mapping {path}")
    finally:
        os.close(fd)
    t = _own(holder, start + lead, nbytes)
    with _LOCK:
        _PENDING.append(_Region(weakref.ref(holder), address, length, file_bytes))
    return t


def promote_resident() -> int:
    """Move every mapped region whose tensors are still alive into anonymous huge pages at the
    same addresses; returns the bytes moved. A region the kernel cannot move stays mapped (a
    warning says why): same bytes, 4 KiB pages."""
    moved = 0
    with _LOCK:
        pending, _PENDING[:] = list(_PENDING), []
        for region in pending:
            holder = region.holder()  # held for the whole move: its munmap must not run now
            if holder is None or holder.closed:
                continue
            try:
                _move_to_huge_pages(region)
                moved += region.file_bytes
            except OSError as e:
                log.warning("weights stay in 4 KiB pages (%s)", e)
            del holder
    return moved


def _move_to_huge_pages(region: _Region) -> None:
    """Copy the region into a fresh anonymous mapping and move that over it, _CHUNK bytes at a
    time: each move unmaps as many file pages as it maps anonymous ones, so the process's RSS
    never holds the matrix twice (a peak a memory limit would see), and a reader in between
    reads some chunks from each, the same bytes."""
    libc = _libc()
    span = region.length + HUGE_PAGE_BYTES
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    base = libc.mmap(None, span, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _MAP_FAILED):
        raise _os_error("an anonymous mapping")
    fresh = base + (-base % HUGE_PAGE_BYTES)
    done = 0  # bytes moved; [fresh + done, base + span) is still the fresh mapping's
    try:
        if libc.madvise(fresh, region.length, mmap.MADV_HUGEPAGE) != 0:
            raise _os_error("madvise(MADV_HUGEPAGE)")
        while done < region.length:
            n = min(_CHUNK, region.length - done)
            copy = min(n, region.file_bytes - done)  # the tail past the file's pages is zeroes
            if copy > 0:
                ctypes.memmove(fresh + done, region.address + done, copy)
            to = region.address + done
            if libc.mremap(fresh + done, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, to) != to:
                raise _os_error("mremap")
            done += n
    finally:  # the alignment slack before, and what was not moved (all of it, on an error)
        if fresh > base:
            libc.munmap(base, fresh - base)
        if base + span > fresh + done:
            libc.munmap(fresh + done, base + span - fresh - done)


def promote_in_background() -> threading.Thread | None:
    """promote_resident in a daemon thread at the lowest CPU priority (a Linux nice value is
    per thread), so serving keeps the cores while it copies; None when nothing is pending."""
    with _LOCK:
        if not _PENDING:
            return None

    def run() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        moved = promote_resident()
        if moved:
            log.info("%.0f MB of weights moved into huge pages", moved / 1e6)

    global _promoter
    thread = threading.Thread(target=run, name="tidal-huge-pages", daemon=True)
    thread.start()
    _promoter = thread
    return thread


def wait_promoted(timeout_s: float | None = None) -> bool:
    """Wait for the promotion promote_in_background started (if any) to finish; False if it is
    still copying after timeout_s. A benchmark waits here so that no copy competes with what it
    times (a 7B file's ~4.7 GB take ~11 s at the lowest priority, longer beside a busy step)."""
    thread = _promoter
    if thread is not None:
        thread.join(timeout_s)
        return not thread.is_alive()
    return True


def resident_copy(src: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of src's bytes (uint8) in memory of its own: huge pages where
    wants_resident says so (tensor parallel's rows of a resident matrix), else a plain clone."""
    nbytes = src.numel() * src.element_size()
    if not wants_resident(nbytes):
        return src.contiguous().clone()
    holder, start = _reserve(nbytes)
    holder.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    out = _own(holder, start, nbytes).view(src.dtype).view(src.shape)
    out.copy_(src)
    return out
