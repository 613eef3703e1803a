"""gguf-py's dequantize + a float64 matmul: the reference every gguf_gemm test checks against.

Tolerances, per output y[m, n], with S = sum_k |x[m, k]| * |w[n, k]|:
  act f32: |y - x @ w.T| <= 1e-5 * S (float32 sums of up to 2048 terms; measured ~3e-8).
  act q8:  |y - xq @ w.T| <= 1e-5 * Sq, xq = x quantized as the kernel does (emulated in numpy),
           and against the exact product the quantization bound |y - x @ w.T| <= sum_k |w| |x - xq|
           (+ 1e-5 * S): typically ~1e-3 * S.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from tidal.kernels import gguf_gemm as gg
from tidal.kernels.bench_gguf import random_blocks

ISAS = gg.isas() if gg.available() else []
TYPES = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q5_0)  # gguf-py 0.x quantizes these; K-quants are random blocks
F32_TOL, Q8_TOL = 1e-5, 1e-5


def k_of(t: Q, blocks32: int = 7, blocks256: int = 2) -> int:
    """K = 32 * odd for the 32-blocks, 256 * k for the 256-value super-blocks."""
    return 32 * blocks32 if gg._BLOCKS[int(t)][1] == 32 else 256 * blocks256


@functools.cache
def weight(t: Q, n: int, k: int, seed: int = 0, random_bytes: bool = False) -> gg.BlockWeight:
    if t in QUANTIZABLE and not random_bytes:
        data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
        return gg.BlockWeight(torch.from_numpy(gq.quantize(data, t)), int(t), n, k)
    return random_blocks(int(t), n, k, seed)  # valid blocks of random codes


def dequantized(w: gg.BlockWeight) -> np.ndarray:
    """gguf-py's float32 dequantization, (rows, cols)."""
    return gq.dequantize(w.blocks.numpy(), Q(w.ggml_type)).reshape(w.rows, w.cols)


def quantize_x(x: np.ndarray, group: int) -> np.ndarray:
    """The kernel's q8 activations, dequantized: per group amax/127 scales, round half to even."""
    g = x.astype(np.float32).reshape(x.shape[0], -1, group)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(g * inv)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def check(y: torch.Tensor, x: torch.Tensor, w: gg.BlockWeight, act: str) -> None:
    wd = dequantized(w).astype(np.float64)
    xd = x.numpy().astype(np.float64)
    exact, scale = xd @ wd.T, np.abs(xd) @ np.abs(wd).T
    got = y.numpy().astype(np.float64)
    if act == "f32":
        err = np.abs(got - exact) / np.maximum(scale, 1e-30)
        assert err.max() <= F32_TOL, f"f32: max error {err.max():.2e} of S"
        return
    xq = quantize_x(xd, gg.Q8_GROUP[w.ggml_type])
    emulated, scale_q = xq @ wd.T, np.abs(xq) @ np.abs(wd).T
    err = np.abs(got - emulated) / np.maximum(scale_q, 1e-30)
    assert err.max() <= Q8_TOL, f"q8 vs emulated quantization: max error {err.max():.2e} of Sq"
    bound = np.abs(xd - xq) @ np.abs(wd).T + 1e-5 * scale
    assert (np.abs(got - exact) <= bound).all(), "q8 outside its quantization error bound"
