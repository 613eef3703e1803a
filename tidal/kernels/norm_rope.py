"""`rms_norm` and `qk_norm_rope_`: a decode step's norms and rotary embedding as single C calls."""

from __future__ import annotations

import ctypes
import functools

import torch

from tidal.kernels.build import load

# Integers and pointers cross as c_void_p: ctypes converts it ~5x faster than c_int64 (see
# gguf_gemm.py); eps crosses as a double.
_word, _double = ctypes.c_void_p, ctypes.c_double
_profiling = torch.autograd._profiler_enabled
_record = torch.profiler.record_function


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("norm_rope")
    if lib is None:
        return None
    lib.tidal_rms_norm.restype = None
    lib.tidal_rms_norm.argtypes = [_word] * 5 + [_double] + [_word] * 2
    lib.tidal_qk_norm_rope.restype = None
    lib.tidal_qk_norm_rope.argtypes = [_word] * 10 + [_double] + [_word] * 2
    return lib


def available() -> bool:
    return _library() is not None


def _takes(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x (..., n) float32 CPU with unit inner stride and rows at one stride -> a new contiguous
    x / sqrt(mean(x^2) + eps) * scale, where `scale` is a contiguous float32 (n,) (Gemma: 1 + w);
    None where the kernel cannot take x (the caller runs torch)."""
    lib = _library()
    if lib is None or not _takes(x) or x.dim() < 1:
        return None
    n = x.shape[-1]
    x2 = x.reshape(-1, n)  # a view for the row-strided inputs tidal makes (e.g. qkv columns)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=torch.float32)
    ldx = x2.stride(0) if rows > 1 else n
    call = (x2.data_ptr(), rows, n, ldx, scale.data_ptr(), eps, out.data_ptr(), n)
    if _profiling():
        with _record("tidal::rms_norm"):
            lib.tidal_rms_norm(*call)
    else:
        lib.tidal_rms_norm(*call)
    return out.view(x.shape)


def qk_norm_rope_(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, KVH, D)
    scale_q: torch.Tensor | None,  # (D,) float32, or None: no q/k norm
    scale_k: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,  # (T, D) float32
    sin: torch.Tensor,
) -> bool:
    """In place: an RMSNorm per head of q and k (when scales are given), then rotate-half rotary
    embedding. Heads must be contiguous within a token (token rows may be strided, as column
    slices of a fused qkv output are). False where the kernel cannot take the inputs."""
    lib = _library()
    if (
        lib is None
        or not (_takes(q) and _takes(k) and _takes(cos) and _takes(sin))
        or q.stride(1) != q.shape[2]
        or k.stride(1) != k.shape[2]
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        return False
    t, h, d = q.shape
    call = (
        q.data_ptr(), k.data_ptr(), t, h, k.shape[1], d, q.stride(0), k.stride(0),
        None if scale_q is None else scale_q.data_ptr(),
        None if scale_k is None else scale_k.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
    )  # fmt: skip
    if _profiling():
        with _record("tidal::qk_norm_rope"):
            lib.tidal_qk_norm_rope(*call)
    else:
        lib.tidal_qk_norm_rope(*call)
    return True
