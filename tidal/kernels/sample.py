"""Sampling's row reductions in C (tidal/kernels/sample.c): draws with temperature, top-k, top-p
and min-p, log-sum-exp, small top-k and rank counts over float32 logits rows, with no (B, V)
temporaries. Every function returns None when the kernel cannot take its input (the caller runs
torch)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tidal.kernels.build import load
from tidal.kernels.isa import ISA_NAMES, default_path, library_paths

_word = ctypes.c_void_p
# the largest k tidal_topk_rows takes (insertion into a sorted list: past this, torch.topk wins)
MAX_TOPK = 256


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("sample")
    if lib is None:
        return None
    for fn, nargs in (
        (lib.tidal_sample_rows, 14),
        (lib.tidal_lse_rows, 7),
        (lib.tidal_topk_rows, 10),
        (lib.tidal_count_greater, 8),
    ):
        fn.restype = ctypes.c_int
        fn.argtypes = [_word] * nargs
    return lib


def available() -> bool:
    return _library() is not None


@functools.cache
def isas() -> list[str]:
    """The paths this machine runs, best first ([] without the library)."""
    return library_paths(_library(), "tidal_sample")


@functools.cache
def default_isa() -> str:
    """The best path at or below env TIDAL_KERNEL_ISA's ceiling (read once per process)."""
    return default_path(isas())


def _takes(x: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and 0 < x.shape[1] < 2**32
        and (x.stride(1) == 1 or x.shape[1] == 1)
    )


def _isa_code(isa: str | None) -> int:
    name = default_isa() if isa is None else isa
    if name not in isas():
        raise ValueError(f"isa {isa!r} cannot run here; this machine runs: {isas()}")
    return ISA_NAMES[name]


def _check(rc: int, what: str) -> None:
    if rc == -12:
        raise MemoryError(f"the {what} kernel ran out of memory")
    if rc != 0:
        raise RuntimeError(f"the {what} kernel returned {rc}")


def sample_rows(
    x: torch.Tensor,
    temperature: list[float],
    top_p: list[float],
    min_p: list[float],
    u: torch.Tensor,
    *,
    rows: list[int] | None = None,
    top_k: list[int] | None = None,
    isa: str | None = None,
) -> torch.Tensor | None:
    """One token per selected row of x (V columns), int64 (B,), drawn by the inverse CDF at
    u[b] (float64, [0, 1)) from softmax(x / temperature[b]) after top-p (1.0: off) and min-p (0.0:
    off). `rows` picks the rows of x (default: all, B = len(x)).

    With `top_k`, x holds each row's candidates best first (as torch.topk returns them), top_k[b]
    keeps the first top_k[b] (0: all), and the result is a column of x, not a token id."""
    lib = _library()
    if lib is None or not _takes(x):
        return None
    count = x.shape[0] if rows is None else len(rows)
    row_ids = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    limit = None if top_k is None else torch.tensor(top_k, dtype=torch.int64)
    temps = torch.tensor(temperature, dtype=torch.float32)
    ps = torch.tensor(top_p, dtype=torch.float32)
    mins = torch.tensor(min_p, dtype=torch.float32)
    u = u.to(torch.float64).contiguous()
    if not (len(temperature) == len(top_p) == len(min_p) == u.numel() == count):
        raise ValueError("sample_rows needs one temperature, top_p, min_p and u per row")
    out = torch.empty(count, dtype=torch.int64)
    if count == 0:
        return out
    rc = lib.tidal_sample_rows(
        x.data_ptr(), x.stride(0), x.shape[1], count,
        None if row_ids is None else row_ids.data_ptr(), int(top_k is not None),
        None if limit is None else limit.data_ptr(), temps.data_ptr(), ps.data_ptr(),
        mins.data_ptr(), u.data_ptr(), out.data_ptr(), _isa_code(isa), torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "sampling")
    return out


def logsumexp_rows(x: torch.Tensor, isa: str | None = None) -> torch.Tensor | None:
    """torch.logsumexp(x, dim=-1) as float32 (B,); a row with a NaN gives NaN, a row whose
    maximum is +-inf gives it."""
    lib = _library()
    if lib is None or not _takes(x):
        return None
    out = torch.empty(x.shape[0], dtype=torch.float32)
    if x.shape[0]:
        rc = lib.tidal_lse_rows(
            x.data_ptr(), x.stride(0), x.shape[1], x.shape[0], out.data_ptr(),
            _isa_code(isa), torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "log-sum-exp")
    return out


def topk_rows(
    x: torch.Tensor, k: int, *, rows: list[int] | None = None, isa: str | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values (B, k) float32, ids (B, k) int64) of the k largest entries of each selected row,
    best first, ties to the lower id: torch.topk(x, k) for k <= MAX_TOPK."""
    lib = _library()
    if lib is None or not _takes(x) or not 0 < k <= min(MAX_TOPK, x.shape[1]):
        return None
    count = x.shape[0] if rows is None else len(rows)
    row_ids = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    vals = torch.empty(count, k, dtype=torch.float32)
    ids = torch.empty(count, k, dtype=torch.int64)
    if count:
        rc = lib.tidal_topk_rows(
            x.data_ptr(), x.stride(0), x.shape[1], count,
            None if row_ids is None else row_ids.data_ptr(), k, vals.data_ptr(), ids.data_ptr(),
            _isa_code(isa), torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "top-k")
    return vals, ids


def count_greater(
    x: torch.Tensor, threshold: torch.Tensor, isa: str | None = None
) -> torch.Tensor | None:
    """(x > threshold[:, None]).sum(-1) as int64 (B,)."""
    lib = _library()
    if lib is None or not _takes(x) or threshold.numel() != x.shape[0]:
        return None
    thr = threshold.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        rc = lib.tidal_count_greater(
            x.data_ptr(), x.stride(0), x.shape[1], x.shape[0], thr.data_ptr(), out.data_ptr(),
            _isa_code(isa), torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "rank")
    return out
