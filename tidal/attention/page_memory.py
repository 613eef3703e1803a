"""zeroed_pages: a zero-filled KV page tensor whose never-written pages cost no resident memory."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zero-filled tensor of `shape`; on the CPU backed by a private anonymous mmap.

    NOTE: torch.zeros writes every byte at start-up, so the whole KV pool became resident
    whether or not a token ever reached it. An anonymous mapping reads as zeros and the kernel
    backs each 4 KiB page only when it is first written, so the pool's RSS follows the blocks
    in use (kv/block_pool.py hands out the most recently released block first to keep it
    there). The bytes are the same zeros torch.zeros gives, so every reader behaves as before:
    the null block and never-written slots read as 0.0 (8-bit pages: code 0 times scale 0).
    MAP_PRIVATE, not Python's default MAP_SHARED: a forked child gets copy-on-write pages, not
    a view of this process's cache. The tensor holds the mapping; it is unmapped with it.
    On other devices this is torch.zeros.
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)
