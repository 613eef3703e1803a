"""Large weight tensors read into memory backed by transparent huge pages.

A GGUF's blocks are memory-mapped from the file, in 4 KiB pages. A kernel that streams a large
matrix once per step (the bundled model's 178 MB Q8_0 LM head, read whole for every decoded
token) then takes a TLB miss every 4 KiB; backed by 2 MiB pages it takes one every 2 MiB. On a
Zen 4 the LM head's one-row product ran 1.13-1.15x faster that way (same bits; see
benchmarks/README.md). So a tensor of at least RESIDENT_MIN_BYTES is read with plain file reads
into an anonymous mapping advised MADV_HUGEPAGE, where the kernel's transparent huge pages are
on ("always" or "madvise"); smaller ones, and every tensor where they are off, stay mapped.

Memory: the copy replaces the mapped pages a process would touch anyway (both count in its
RSS); the file's pages are read through the page cache, never mapped, so nothing is resident
twice. Two engine processes on one file each hold their own copy of these tensors, where a
mapping would share the page cache between them.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
# Only tensors this large: the bundled model's LM head (178 MB); a smaller one would round up to
# whole huge pages for little gain.
RESIDENT_MIN_BYTES = 32 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether MADV_HUGEPAGE can back anonymous memory here (THP "always" or "madvise")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def wants_resident(nbytes: int) -> bool:
    return nbytes >= RESIDENT_MIN_BYTES and huge_pages_available()


def _huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with `nbytes` from a huge-page boundary (returned as `start`),
    advised MADV_HUGEPAGE before anything touches it."""
    # Private: a shared anonymous mapping is shmem, whose huge pages are another setting.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    start = -base % HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return mapping, start


def _tensor_of(mapping: mmap.mmap, start: int, nbytes: int) -> torch.Tensor:
    t = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
    _RESIDENT.add(t.untyped_storage().data_ptr())
    return t


# The storages read_resident and resident_copy made (their start addresses; never forgotten: a
# stale entry only makes slice_blocks copy where it could have viewed)
_RESIDENT: set[int] = set()


def is_resident(t: torch.Tensor) -> bool:
    """Whether t (or the tensor it views) is memory of its own made here, not a file's mapping."""
    return t.untyped_storage().data_ptr() in _RESIDENT


def read_resident(path: str | Path, offset: int, nbytes: int) -> torch.Tensor:
    """The file's bytes [offset, offset + nbytes) as a uint8 tensor in anonymous memory aligned
    to, and advised for, huge pages. The tensor keeps the mapping alive."""
    if nbytes <= 0:
        raise ValueError(f"nbytes {nbytes} must be positive")
    mapping, start = _huge_page_mapping(nbytes)
    view = memoryview(mapping)[start : start + nbytes]
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        done = 0
        while done < nbytes:
            got = fh.readinto(view[done:])
            if not got:
                raise OSError(f"{path}: {nbytes - done} bytes short at offset {offset + done}")
            done += got
    view.release()
    return _tensor_of(mapping, start, nbytes)


def resident_copy(src: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of src's bytes (uint8) in memory of its own: huge pages where
    wants_resident says so (tensor parallel's rows of a resident matrix), else a plain clone."""
    nbytes = src.numel() * src.element_size()
    if not wants_resident(nbytes):
        return src.contiguous().clone()
    mapping, start = _huge_page_mapping(nbytes)
    out = _tensor_of(mapping, start, nbytes).view(src.dtype).view(src.shape)
    out.copy_(src)
    return out
