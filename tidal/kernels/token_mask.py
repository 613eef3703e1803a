"""`apply_token_bitmask_`: grammar bitmasks applied to a batch's logits rows in one C call."""

from __future__ import annotations

import ctypes
import functools

import torch

from tidal.kernels.build import load

_word = ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("token_mask")
    if lib is None:
        return None
    lib.tidal_apply_token_bitmask.restype = ctypes.c_int64
    lib.tidal_apply_token_bitmask.argtypes = [_word] * 7
    return lib


def available() -> bool:
    return _library() is not None


def apply_token_bitmask_(logits: torch.Tensor, masks: torch.Tensor, rows: list[int]) -> bool:
    """In place: logits (B, V) float32 CPU with unit inner stride; masks (len(rows), W) int32
    contiguous, mask i for logits row rows[i]; disallowed tokens become -inf (a row allowing
    none is left as is). False when the kernel cannot take them (the caller runs torch)."""
    lib = _library()
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.stride(-1) != 1
        or masks.dtype != torch.int32
        or not masks.is_contiguous()
        or masks.shape[0] != len(rows)
    ):
        return False
    row_ids = torch.tensor(rows, dtype=torch.int64)
    lib.tidal_apply_token_bitmask(
        logits.data_ptr(), logits.stride(0), logits.shape[1], masks.data_ptr(),
        masks.shape[1], row_ids.data_ptr(), len(rows),
    )  # fmt: skip
    return True
