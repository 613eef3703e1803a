"""`argmax_rows`: greedy decoding's torch.argmax(dim=-1) over float32 logits, in one C call."""

from __future__ import annotations

import ctypes
import functools

import torch

from tidal.kernels.build import load
from tidal.kernels.isa import ISA_NAMES, default_path, library_paths

_word = ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("argmax")
    if lib is None:
        return None
    lib.tidal_argmax_rows.restype = ctypes.c_int
    # x, ld, n, B, out, isa, threads
    lib.tidal_argmax_rows.argtypes = [_word] * 7
    return lib


def available() -> bool:
    return _library() is not None


@functools.cache
def isas() -> list[str]:
    """The paths this machine runs, best first ([] without the library)."""
    return library_paths(_library(), "tidal_argmax")


@functools.cache
def default_isa() -> str:
    """The best path at or below env TIDAL_KERNEL_ISA's ceiling (read once per process)."""
    return default_path(isas())


def argmax_rows(logits: torch.Tensor, isa: str | None = None) -> torch.Tensor | None:
    """torch.argmax(logits, dim=-1) (int64, first maximal index, NaN counted as largest) for
    logits (B, V) float32 on the CPU with unit inner stride; None when the kernel cannot take
    them (the caller runs torch). `isa` names a path from `isas()` (default: the best)."""
    lib = _library()
    if (
        lib is None
        or logits.dim() != 2
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.shape[1] == 0
        or (logits.stride(1) != 1 and logits.shape[1] > 1)
    ):
        return None
    name = default_isa() if isa is None else isa
    if name not in isas():
        raise ValueError(f"isa {isa!r} cannot run here; this machine runs: {isas()}")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0] == 0:
        return out
    rc = lib.tidal_argmax_rows(
        logits.data_ptr(), logits.stride(0), logits.shape[1], logits.shape[0], out.data_ptr(),
        ISA_NAMES[name], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"argmax kernel returned {rc}")
    return out
