"""`int8_gemm`, `int4_gemm`, `fp8_gemm`: weight-only quantized matmuls for decode-sized batches on CPU."""

from __future__ import annotations

import ctypes
import functools

import torch

from tidal.kernels.build import load

_ptr, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _library():
    lib = load("int8_gemm")
    if lib is None:
        return None
    lib.tidal_int8_gemm_f32.restype = None
    lib.tidal_int8_gemm_f32.argtypes = [
        _ptr, _i64, _i64, _i64,  # x, M, K, ldx
        _ptr, _ptr, _i64, _ptr,  # codes, scales, group size, bias
        _ptr, _i64, _int,  # y, N, threads
    ]  # fmt: skip
    lib.tidal_int4_gemm_f32.restype = _int
    lib.tidal_int4_gemm_f32.argtypes = [
        _ptr, _i64, _i64, _i64,  # x, M, K, ldx
        _ptr, _ptr, _ptr, _ptr,  # packed codes, scales, mins, bias
        _ptr, _i64, _int,  # y, N, threads
    ]  # fmt: skip
    lib.tidal_fp8_gemm_f32.restype = None
    lib.tidal_fp8_gemm_f32.argtypes = [
        _ptr, _i64, _i64, _i64,  # x, M, K, ldx
        _ptr, _ptr, _ptr,  # codes, scales, bias
        _ptr, _i64, _int,  # y, N, threads
    ]  # fmt: skip
    return lib


def available() -> bool:
    return _library() is not None


def _takes(x: torch.Tensor) -> bool:
    """The kernels read CPU float32 x with unit inner stride. The parameters' contract (contiguous,
    float32 scales/mins/bias) is the calling module's, checked once when it is built: this runs
    ~130 times per decode step."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and (x.stride(1) == 1 or x.shape[1] == 1)
    )


def _row_stride(x: torch.Tensor) -> int:
    return x.stride(0) if x.shape[0] > 1 else x.shape[1]


def int8_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """(M, K) float32 x, (N, K) int8 codes, (N, K // G) float32 scales (G = the group size, a
    multiple of 8; G = K is one scale per row), optional (N,) float32 bias -> (M, N) float32
    x @ w.T + bias with w[n, k] = codes[n, k] * scales[n, k // G]; None where the kernel cannot
    take x (the caller then runs its torch fallback). Parameters: contiguous, float32 scales and
    bias (not checked here: see _takes)."""
    lib = _library()
    if lib is None or not _takes(x):
        return None
    m, k = x.shape
    n, groups = scales.shape
    group = k // groups
    if group % 8 or group * groups != k:
        return None
    y = torch.empty((m, n), dtype=torch.float32)
    lib.tidal_int8_gemm_f32(
        x.data_ptr(), m, k, _row_stride(x), codes.data_ptr(), scales.data_ptr(), group,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return y


def int4_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """(M, K) float32 x, (N, K // 2) uint8 packed codes (tidal.quant.int4.pack_nibbles),
    (N, K // 32) float32 scales and mins -> (M, N) float32 x @ w.T + bias with
    w[n, k] = q[n, k] * scales[n, k // 32] + mins[n, k // 32]; None where the kernel cannot
    take x. Parameters: contiguous, float32 scales, mins and bias (not checked here)."""
    lib = _library()
    if lib is None or not _takes(x) or x.shape[1] % 32:
        return None
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    rc = lib.tidal_int4_gemm_f32(
        x.data_ptr(), m, k, _row_stride(x), packed.data_ptr(), scales.data_ptr(),
        mins.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), n,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("int4_gemm: allocating the group sums failed")
    return y


def fp8_gemm(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """(M, K) float32 x, (N, K) float8_e4m3fn codes, (N,) float32 scales -> (M, N) float32
    x @ (codes * scales[:, None]).T + bias; None where the kernel cannot take x. Parameters:
    contiguous, float32 scales and bias (not checked here)."""
    lib = _library()
    if lib is None or not _takes(x) or x.shape[1] % 8:
        return None
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    lib.tidal_fp8_gemm_f32(
        x.data_ptr(), m, k, _row_stride(x), codes.data_ptr(), scales.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return y
