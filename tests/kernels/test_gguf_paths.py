"""gguf_gemm's ISA paths against each other: q8 gives the same bits on every path and batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.kernels.gguf_reference import F32_TOL, ISAS, TYPES, check, dequantized, k_of, weight
from tidal.kernels import gguf_gemm as gg
from tidal.kernels.bench_gguf import random_blocks
from tidal.kernels.build import cpu_flags
from tidal.kernels.isa import ISA_CPU_FLAGS, PATH_ORDER

pytestmark = pytest.mark.skipif(not gg.available(), reason="no C compiler: the torch fallback runs")


@pytest.mark.skipif(len(ISAS) < 2, reason="only the scalar path runs here")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("act", gg.ACTS)
def test_scalar_agrees_with_simd(t: Q, act: str) -> None:
    """f32: another summation order, within 2e-6 of S. q8: the same exact integers and the same
    float steps (one FMA per run), so the same bits."""
    k = k_of(t)
    w = weight(t, 19, k)
    torch.manual_seed(5)
    x = torch.randn(6, k)
    fast, slow = gg.gguf_gemm(x, [w], act, ISAS[0]), gg.gguf_gemm(x, [w], act, "scalar")
    if act == "q8":
        assert torch.equal(fast, slow)
        return
    scale = torch.from_numpy(np.abs(x.numpy()) @ np.abs(dequantized(w)).T)
    assert ((fast - slow).abs() <= 2e-6 * scale).all()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_q8_paths_give_the_same_bits(t: Q) -> None:
    """q8 on the SIMD paths: one or two rows of x meet the weights in place, more go through
    panels of eight weight rows (side by side in pairs on AVX-512), 16 runs and 64 (AVX-512:
    128) rows of x at a time. Shapes past every one of those bounds (N 45: two pairs of groups
    and a pair of 8 + 5 rows, and N 21: a pair and a lone part; 41 runs of 32 or 5
    super-blocks: three slabs; M 130: three or two passes of rows) give the portable C's bits
    on each path, whatever the batch and the thread count."""
    for n in (45, 21):
        _q8_paths_same_bits(t, n)


def _q8_paths_same_bits(t: Q, n: int) -> None:
    k = k_of(t, 41, 5)
    w = weight(t, n, k, seed=13, random_bytes=True)
    torch.manual_seed(13)
    x = torch.randn(130, k)
    ref = gg.gguf_gemm(x, w, "q8", "scalar")
    check(ref, x, w, "q8")
    for isa in ISAS:
        full = gg.gguf_gemm(x, w, "q8", isa, threads=2)
        assert torch.equal(full, ref), isa
        for lo, hi in ((0, 1), (7, 9), (3, 6), (64, 128), (1, 130)):
            assert torch.equal(gg.gguf_gemm(x[lo:hi], w, "q8", isa), ref[lo:hi]), (isa, lo, hi)
        assert torch.equal(gg.gguf_gemm(x, w, "q8", isa, threads=3), ref), isa


def test_isas_and_the_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIDAL_KERNEL_ISA", raising=False)  # the suite may run under a ceiling
    gg.default_isa.cache_clear()
    assert ISAS[-1] == "scalar" and gg.default_isa() == ISAS[0]
    assert ISAS == sorted(ISAS, key=PATH_ORDER.index, reverse=True)  # best first
    lib = gg._library()
    if ISA_CPU_FLAGS["avx512"] <= cpu_flags() and lib.tidal_gguf_has_avx512():
        assert "avx512" in ISAS and ISAS[0] in ("amx", "avx512")
    # AVX-VNNI wherever the build has it and the CPU runs it (a Zen 5 has it beside AVX-512)
    vex = ISA_CPU_FLAGS["avx2vnni"] <= cpu_flags() and lib.tidal_gguf_has_avx2vnni()
    assert ("avx2vnni" in ISAS) == bool(vex)
    # AMX wherever the build has it, the CPU runs it and the OS grants the tile state
    amx = ISA_CPU_FLAGS["amx"] <= cpu_flags() and lib.tidal_gguf_has_amx()
    assert ("amx" in ISAS) == bool(amx) and (not amx or ISAS[0] == "amx")
    # each name is a ceiling: the best path at or below it (=avx512 on an AVX2 machine: avx2;
    # =avx2 on an AVX-VNNI machine: plain AVX2, as a machine without it runs)
    above: list[str] = []
    expect = {}
    for name in reversed(PATH_ORDER):
        expect[name] = next(i for i in ISAS if i not in above)
        above.append(name)
    try:
        for name, path in expect.items():
            monkeypatch.setenv("TIDAL_KERNEL_ISA", name)
            gg.default_isa.cache_clear()
            assert gg.default_isa() == path
            assert gg._isa_code(None) == gg._ISA_CODES[path]
        monkeypatch.setenv("TIDAL_KERNEL_ISA", "neon")
        gg.default_isa.cache_clear()
        with pytest.raises(ValueError, match="TIDAL_KERNEL_ISA"):
            gg.default_isa()
    finally:
        gg.default_isa.cache_clear()


@pytest.mark.skipif("avx512" not in ISAS, reason="no AVX-512 VNNI path here")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_avx512_against_avx2(t: Q) -> None:
    """q8: AVX-512 runs AVX2's q8 kernels with VNNI's int32 dot products (the signed types'
    codes offset by 128): the same integers, so equal bits. f32: another summation order (and
    table-decoded weights), within the f32 tolerance of each other."""
    k = k_of(t, 9, 3)
    w = weight(t, 35, k, random_bytes=True)
    torch.manual_seed(6)
    x = torch.randn(11, k)
    assert torch.equal(gg.gguf_gemm(x, w, "q8", "avx512"), gg.gguf_gemm(x, w, "q8", "avx2"))
    f512, f2 = gg.gguf_gemm(x, w, "f32", "avx512"), gg.gguf_gemm(x, w, "f32", "avx2")
    scale = torch.from_numpy(np.abs(x.numpy()) @ np.abs(dequantized(w)).T)
    assert ((f512 - f2).abs() <= 2 * F32_TOL * scale).all()
    check(f512, x, w, "f32")


@pytest.mark.skipif("avx2vnni" not in ISAS, reason="no AVX-VNNI path here")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 11, 70])
def test_avx2vnni_against_avx2(t: Q, m: int) -> None:
    """AVX-VNNI is AVX2's path with vpdpbusd for q8's integer sums: with a row of x in place
    (M <= 2), through the panels (in tiles of AVX2's height) and past one pass of 64 rows, the
    same integers, so AVX2's bits in both modes."""
    x, w = _same_bits_on_both(t, m, "avx2vnni", "avx2")
    check(gg.gguf_gemm(x, w, "q8", "avx2vnni"), x, w, "q8")


def _same_bits_on_both(t: Q, m: int, path: str, base: str) -> tuple[torch.Tensor, gg.BlockWeight]:
    """Asserts that `path` gives `base`'s bits in both modes on M = m rows of x against 35 rows of
    random blocks of type t (K an odd count of blocks); returns (x, w)."""
    k = k_of(t, 9, 3)
    w = weight(t, 35, k, random_bytes=True)
    torch.manual_seed(m)
    x = torch.randn(m, k)
    for act in gg.ACTS:
        assert torch.equal(gg.gguf_gemm(x, w, act, path), gg.gguf_gemm(x, w, act, base))
    return x, w


@pytest.mark.skipif("amx" not in ISAS, reason="no AMX path here")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [5, 6, 11, 12, 13, 16, 17, 33, 70])
def test_amx_against_avx512(t: Q, m: int) -> None:
    """AMX is AVX-512's path with the tile unit's int8 dot products for q8 from 6 (Q8_0) or 12
    rows of x (the other types but Q6_K): the same integers and float steps, so AVX-512's bits,
    on either side of both thresholds, with a tile of x cut short (6 to 13, 17, 33, 70), weight
    rows past the last tile of 16 (N 35), every thread count, and in a fused call (from 6 to 11
    rows a Q8_0 segment runs on the tiles beside a Q5_0 one on AVX-512)."""
    x, w = _same_bits_on_both(t, m, "amx", "avx512")
    k = w.cols
    for threads in (1, 3):
        want = gg.gguf_gemm(x, w, "q8", "avx512", threads=threads)
        assert torch.equal(gg.gguf_gemm(x, w, "q8", "amx", threads=threads), want)
    kquant = gg._BLOCKS[int(t)][1] == 256
    pair = (Q.Q6_K, Q.Q4_K) if kquant else (Q.Q8_0, Q.Q5_0)  # another type beside it
    other = weight(pair[0] if t != pair[0] else pair[1], 20, k, random_bytes=True)
    fused = gg.gguf_gemm(x, [w, other], "q8", "amx")
    assert torch.equal(fused, gg.gguf_gemm(x, [w, other], "q8", "avx512"))
    check(fused[:, :35], x, w, "q8")


@pytest.mark.skipif("amx" not in ISAS, reason="no AMX path here")
@pytest.mark.parametrize("t", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS], ids=lambda t: t.name)
def test_amx_groups_and_k_blocks_give_the_same_bits(t: Q) -> None:
    """The tile path decodes up to eight panels of 16 weight rows at once and takes K in blocks
    of 112 runs, each output's float chain going on from one block to the next: with N 531 (four
    whole groups of 128 rows, then one of two panels, the last three rows long) and K 3840 (a
    block of 112 runs and one of 8), AVX-512's bits, on one thread and two; 200 rows of x (a
    last tile of 8), past where Q6_K takes the tiles (192)."""
    k = 3840
    w = weight(t, 531, k, random_bytes=True)
    torch.manual_seed(12)
    x = torch.randn(200, k)
    for threads in (1, 2):
        want = gg.gguf_gemm(x, w, "q8", "avx512", threads=threads)
        assert torch.equal(gg.gguf_gemm(x, w, "q8", "amx", threads=threads), want)
    check(want, x, w, "q8")
    if t in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # the integers at their widest (Q6_K: s - smin near 2^24)
        wide = _extreme_k_blocks(t, 40, k)
        xw = (torch.rand(200, 1) + 0.5).expand(200, k).contiguous()  # every code of x 127
        want = gg.gguf_gemm(xw, wide, "q8", "scalar")
        assert torch.equal(gg.gguf_gemm(xw, wide, "q8", "amx"), want)
        assert torch.equal(gg.gguf_gemm(xw, wide, "q8", "avx512"), want)


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _extreme_k_blocks(t: Q, n: int, k: int) -> gg.BlockWeight:
    """Every code and 6-bit scale (and min) at its largest, Q6_K's int8 scales at -128: the
    integer sums at their widest, which a lane mix-up or an overflow would not survive."""
    w = random_blocks(int(t), n, k, seed=3)
    b = w.blocks.numpy().reshape(n, k // 256, -1)
    if t == Q.Q6_K:
        b[..., :192] = 0xFF
        b[..., 192:208] = 0x80
    else:
        b[..., 4:] = 0xFF  # scales, mins, Q5_K's fifth bits and the codes
    return w


@pytest.mark.skipif(len(ISAS) < 2, reason="only the scalar path runs here")
@pytest.mark.parametrize("t", K_QUANTS, ids=lambda t: t.name)
def test_kquant_decode_rows_give_the_same_bits(t: Q) -> None:
    """One to four rows of x against K-quant rows run the decode kernels (two rows a call): sixteen rows a call on
    AVX-512 (gguf_kdecode_avx512.c), eight of Q4_K/Q5_K on AVX2 and AVX-VNNI
    (gguf_kdecode_avx2.c), their sums reduced together. For each count of rows in the last call
    (1..16, and 17 and 33: a call and a part), random and widest blocks give the portable C's
    bits, as more rows of x give them (panels, tiles)."""
    if "avx512" in ISAS:
        assert gg._library().tidal_gguf_kdecode_built() == 1
    k = k_of(t, blocks256=3)
    torch.manual_seed(int(t))
    x = torch.randn(9, k) * 3
    for n in (*range(1, 17), 17, 33):
        for w in (weight(t, n, k, seed=n, random_bytes=True), _extreme_k_blocks(t, n, k)):
            ref = gg.gguf_gemm(x, w, "q8", "scalar")
            for isa in ISAS[:-1]:
                for m in (1, 2, 3, 4):  # 3, 4: two calls, the weight rows read again from cache
                    assert torch.equal(gg.gguf_gemm(x[:m], w, "q8", isa), ref[:m]), (isa, n, m)
                # the same rows of x inside a batch: the panels' (or tiles') bits
                assert torch.equal(gg.gguf_gemm(x, w, "q8", isa)[:2], ref[:2]), (isa, n)
