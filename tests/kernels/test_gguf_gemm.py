"""gguf_gemm against gguf-py's dequantize + a float64 matmul (tests/kernels/gguf_reference.py,
its tolerances), for every ggml type and ISA path here; test_gguf_paths.py compares the paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.kernels.gguf_reference import ISAS, TYPES, check, dequantized, k_of, weight
from tidal.kernels import gguf_gemm as gg
from tidal.kernels.bench_gguf import random_blocks

pytestmark = pytest.mark.skipif(not gg.available(), reason="no C compiler: the torch fallback runs")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("act", gg.ACTS)
def test_matches_reference_for_every_batch_size(isa: str, t: Q, act: str) -> None:
    n, k = 37, k_of(t)  # 37: not a multiple of any tile or chunk
    w = weight(t, n, k)
    torch.manual_seed(1)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 14, 31, 32, 33, 64):
        x = torch.randn(m, k)
        y = gg.gguf_gemm(x, [w], act, isa)
        assert y is not None and y.shape == (m, n) and y.dtype == torch.float32
        check(y, x, w, act)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", gg.ACTS)
def test_q8_0_codes_of_minus_128(isa: str, act: str) -> None:
    """ggml never writes -128, but a file may hold it: the sign trick must not overflow."""
    w = weight(Q.Q8_0, 8, 96, random_bytes=True)
    assert (w.blocks.numpy().reshape(8, 3, 34)[..., 2:] == 128).any()
    x = torch.randn(5, 96)
    check(gg.gguf_gemm(x, [w], act, isa), x, w, act)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("act", gg.ACTS)
def test_rows_are_bit_identical_whatever_the_batch(isa: str, t: Q, act: str) -> None:
    n, k = 21, k_of(t, 3, 1)
    w = weight(t, n, k)
    torch.manual_seed(2)
    x = torch.randn(13, k)
    full = gg.gguf_gemm(x, [w], act, isa, threads=2)
    for m in range(13):  # alone: row 0 of a tile of 1
        assert torch.equal(gg.gguf_gemm(x[m : m + 1], [w], act, isa), full[m : m + 1])
    # other places in other tiles; short tiles (2-4 rows) take the K-quants' one-pass path
    for lo, hi in ((1, 6), (3, 10), (5, 13), (2, 4), (6, 9), (9, 13)):
        assert torch.equal(gg.gguf_gemm(x[lo:hi], [w], act, isa), full[lo:hi])
    for threads in (1, 3):
        assert torch.equal(gg.gguf_gemm(x, [w], act, isa, threads=threads), full)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", gg.ACTS)
@pytest.mark.parametrize(
    "types",
    [
        (Q.Q5_0, Q.Q5_0, Q.Q8_0),
        (Q.Q4_K, Q.Q6_K),
        (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q4_0),
        (Q.IQ4_XS, Q.Q4_K, Q.IQ4_NL),  # runs of 32 in super-blocks, K-quants, 32-blocks
    ],
    ids=lambda ts: "+".join(t.name for t in ts),
)
@pytest.mark.parametrize("k", [512, 2304])  # 2304 x 6 rows: the K-sliced tiles on AVX2 f32
def test_segments_equal_separate_calls(isa: str, act: str, types: tuple[Q, ...], k: int) -> None:
    # k: shared by 32-blocks and K-quants
    ws = [weight(t, n, k, seed=i) for i, (t, n) in enumerate(zip(types, (40, 9, 17, 3)))]
    torch.manual_seed(3)
    x = torch.randn(6, k)
    fused = gg.gguf_gemm(x, ws, act, isa)
    alone = torch.cat([gg.gguf_gemm(x, w, act, isa) for w in ws], dim=1)
    assert torch.equal(fused, alone)
    prepared = gg.BlockSegments(tuple(ws))
    assert prepared.rows == fused.shape[1] and list(prepared) == ws
    assert torch.equal(gg.gguf_gemm(x, prepared, act, isa), fused)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "act"), [(224, "q8"), (224, "f32"), (2304, "f32")])
def test_strided_x_and_an_out_slice(isa: str, k: int, act: str) -> None:
    """x a column slice of a wider buffer, y written into a column slice; K=2304 at 5 rows
    takes the K-sliced tiles on AVX2 with float activations."""
    w = weight(Q.Q5_0, 37, k)
    torch.manual_seed(4)
    x = torch.randn(5, k + 76)[:, 10 : 10 + k]  # row stride k + 76
    wide = torch.full((5, 50), -1.0)
    y = gg.gguf_gemm(x, [w], act, isa, out=wide[:, 3:40])
    assert torch.equal(y, gg.gguf_gemm(x.contiguous(), [w], act, isa))
    assert (wide[:, :3] == -1).all() and (wide[:, 40:] == -1).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact(isa: str, t: Q) -> None:
    w = weight(t, 37, k_of(t))
    ref = dequantized(w)
    rows = gg.dequantize_rows(w, 0, w.rows, isa)
    assert np.array_equal(rows.numpy(), ref)
    assert np.array_equal(gg.dequantize_rows(w, 5, 9, isa).numpy(), ref[5:9])
    ids = torch.tensor([36, 0, 7, 7, 12])
    assert np.array_equal(gg.dequantize_gather(w, ids, isa).numpy(), ref[ids.numpy()])
    assert gg.dequantize_gather(w, torch.tensor([], dtype=torch.int64), isa).shape == (0, w.cols)


def test_block_table_matches_the_loader() -> None:
    from tidal.quant.gguf_types import BLOCK_SIZES, GGMLType

    for t, (name, elems, nbytes) in gg._BLOCKS.items():
        assert GGMLType(t).name == name and BLOCK_SIZES[GGMLType(t)] == (elems, nbytes)
    assert GGMLType.Q8_0 in gg.SUPPORTED_TYPES


@pytest.mark.parametrize("t", [Q.Q5_0, Q.Q4_K])
def test_dequantize_into_rows_of_a_wider_buffer(t: Q) -> None:
    w = weight(t, 9, k_of(t))
    wide = torch.full((12, w.cols + 7), -1.0)
    view = wide[2:11, 3 : 3 + w.cols]
    assert gg.dequantize_rows(w, 0, w.rows, out=view) is view
    assert np.array_equal(view.numpy(), dequantized(w))
    assert (wide[:2] == -1).all() and (wide[:, :3] == -1).all()  # nothing outside the view
    with pytest.raises(ValueError, match="out must be"):
        gg.dequantize_rows(w, 0, 4, out=torch.empty(5, w.cols))
    with pytest.raises(ValueError, match="out must be"):
        gg.dequantize_rows(w, 0, 4, out=torch.empty(w.cols, 4).t())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("act", gg.ACTS)
def test_every_batch_from_1_to_64_gives_the_same_rows(isa: str, t: Q, act: str) -> None:
    """Odd shapes (N 35: two chunks and a part; K an odd count of blocks) and every M up to 64:
    each prefix of the batch gives its rows' bits as computed in the full batch."""
    n, k = 35, k_of(t, 5, 3)
    w = weight(t, n, k, seed=7, random_bytes=True)
    torch.manual_seed(7)
    x = torch.randn(64, k)
    full = gg.gguf_gemm(x, w, act, isa)
    check(full, x, w, act)
    for m in range(1, 64):
        assert torch.equal(gg.gguf_gemm(x[:m], w, act, isa), full[:m]), f"M={m}"
        assert torch.equal(gg.gguf_gemm(x[64 - m :], w, act, isa), full[64 - m :]), f"M={m}"


def test_refusals_and_errors() -> None:
    w = weight(Q.Q8_0, 4, 64)
    x = torch.randn(2, 64)
    assert gg.gguf_gemm(x.double(), [w]) is None
    assert gg.gguf_gemm(torch.randn(64, 2).t(), [w]) is None  # inner stride 2
    assert gg.gguf_gemm(torch.randn(0, 64), [w]).shape == (0, 4)
    with pytest.raises(ValueError, match="K=32"):
        gg.gguf_gemm(torch.randn(2, 32), [w])
    with pytest.raises(ValueError, match="segments"):
        gg.gguf_gemm(x, [w] * 5)
    with pytest.raises(ValueError, match="share cols"):
        gg.BlockSegments((w, weight(Q.Q8_0, 4, 96)))
    with pytest.raises(ValueError, match="act"):
        gg.gguf_gemm(x, [w], "int4")
    with pytest.raises(ValueError, match="isa"):
        gg.gguf_gemm(x, [w], isa="neon")
    if "avx512" not in ISAS:  # a path this machine cannot run is refused, not run lower
        with pytest.raises(ValueError, match="isa"):
            gg.gguf_gemm(x, [w], isa="avx512")
    with pytest.raises(ValueError, match="out"):
        gg.gguf_gemm(x, [w], out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="ggml_type"):
        gg.BlockWeight(torch.zeros(4, 36, dtype=torch.uint8), 3, 4, 64)  # Q4_1: not here
    with pytest.raises(ValueError, match="cols"):
        gg.BlockWeight(torch.zeros(4, 34, dtype=torch.uint8), int(Q.Q8_0), 4, 48)
    with pytest.raises(ValueError, match="shape"):
        gg.BlockWeight(torch.zeros(4, 34, dtype=torch.uint8), int(Q.Q8_0), 4, 64)
    with pytest.raises(ValueError, match="rows"):
        gg.dequantize_rows(w, 2, 5)
    with pytest.raises(ValueError, match="ids"):
        gg.dequantize_gather(w, torch.tensor([4]))


def test_a_moved_storage_is_refused() -> None:
    w = gg.BlockWeight(weight(Q.Q8_0, 4, 64).blocks.clone(), int(Q.Q8_0), 4, 64)
    x = torch.randn(2, 64)
    before, prepared = gg.gguf_gemm(x, w), gg.BlockSegments((w,))
    w.blocks.share_memory_()  # re-points the tensor at a new storage
    for segments in (w, [w, w], prepared):
        with pytest.raises(ValueError, match="moved"):
            gg.gguf_gemm(x, segments)
    assert torch.equal(gg.gguf_gemm(x, gg.BlockWeight(w.blocks, int(Q.Q8_0), 4, 64)), before)


def test_profiler_sees_the_kernel() -> None:
    w = weight(Q.Q8_0, 4, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gg.gguf_gemm(torch.randn(2, 64), w)
        gg.dequantize_rows(w, 0, 2)
    names = {e.name for e in prof.events()}
    assert {"tidal::gguf_gemm", "tidal::gguf_dequantize"} <= names


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("act", gg.ACTS)
def test_long_rows_sliced_over_k_keep_every_rows_bits(isa: str, t: Q, act: str) -> None:
    """Rows long enough that a tile's x outgrows L1: on AVX2 with float activations the kernel
    walks K in slices (an uneven last one here: 129 runs of 32, 9 super-blocks), keeping each
    accumulator between them. A row alone (one whole pass) and every tile height give the
    same bits, and the values match float64."""
    n, k = 19, k_of(t, 129, 9)
    w = weight(t, n, k, seed=11, random_bytes=True)
    torch.manual_seed(11)
    x = torch.randn(20, k)
    full = gg.gguf_gemm(x, w, act, isa, threads=2)
    check(full, x, w, act)
    for m in (1, 2, 3, 5, 8, 11):
        assert torch.equal(gg.gguf_gemm(x[:m], w, act, isa), full[:m]), f"M={m}"
    for m in range(20):
        assert torch.equal(gg.gguf_gemm(x[m : m + 1], w, act, isa), full[m : m + 1]), f"row {m}"


# ---- gguf_gemm_panels: the prefill-sized float product (AVX2) ----

needs_panels = pytest.mark.skipif("avx2" not in ISAS, reason="the panel kernel is AVX2 only")


@needs_panels
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_panels_match_reference_for_odd_shapes(t: Q) -> None:
    """N 35 (two panels of 16 and a part), K an odd count of blocks, M from 1 to 40 (every
    remainder of the 6-row blocks): the float32 product within F32_TOL of S, and each batch's
    rows bit-identical to the same rows in the full batch."""
    n, k = 35, k_of(t, 5, 3)
    w = weight(t, n, k, seed=11, random_bytes=True)
    torch.manual_seed(11)
    x = torch.randn(40, k)
    full = gg.gguf_gemm_panels(x, w)
    check(full, x, w, "f32")
    for m in range(1, 40):
        assert torch.equal(gg.gguf_gemm_panels(x[:m], w), full[:m]), f"M={m}"
        assert torch.equal(gg.gguf_gemm_panels(x[40 - m :], w), full[40 - m :]), f"M={m}"


@needs_panels
def test_panels_segments_strides_threads() -> None:
    """Fused segments of different types equal separate calls; a strided x and an out slice;
    one thread and two give the same bits."""
    k = 512
    ws = [weight(Q.Q5_0, 40, k, seed=1), weight(Q.Q4_K, 24, k, seed=2), weight(Q.Q8_0, 7, k)]
    torch.manual_seed(3)
    wide = torch.randn(50, k + 9)
    x = wide[:, 4 : 4 + k]
    fused = gg.gguf_gemm_panels(x, ws)
    apart = torch.cat([gg.gguf_gemm_panels(x.contiguous(), [w]) for w in ws], dim=1)
    assert torch.equal(fused, apart)
    for w, y in zip(ws, apart.split([w.rows for w in ws], dim=1)):
        check(y.contiguous(), x.contiguous(), w, "f32")
    buf = torch.full((50, 80), -1.0)
    gg.gguf_gemm_panels(x, ws, out=buf[:, 3:74])
    assert torch.equal(buf[:, 3:74], fused)
    assert (buf[:, :3] == -1).all() and (buf[:, 74:] == -1).all()
    assert torch.equal(gg.gguf_gemm_panels(x, ws, threads=1), fused)


@needs_panels
def test_panels_refusals() -> None:
    w = weight(Q.Q8_0, 4, 64)
    assert gg.gguf_gemm_panels(torch.randn(2, 64).double(), [w]) is None
    assert gg.gguf_gemm_panels(torch.randn(64, 2).t(), [w]) is None  # inner stride 2
    assert gg.gguf_gemm_panels(torch.randn(0, 64), [w]).shape == (0, 4)
    with pytest.raises(ValueError, match="K=32"):
        gg.gguf_gemm_panels(torch.randn(2, 32), [w])
    with pytest.raises(ValueError, match="out"):
        gg.gguf_gemm_panels(torch.randn(2, 64), [w], out=torch.empty(2, 5))


@needs_panels
def test_profiler_sees_the_panel_kernel() -> None:
    w = weight(Q.Q8_0, 16, 64)
    with torch.profiler.profile() as prof:
        gg.gguf_gemm_panels(torch.randn(40, 64), w)
    assert "tidal::gguf_gemm_panels" in {e.name for e in prof.events()}


def test_bench_paths_compute_the_product_into_one_output() -> None:
    """bench_gguf's timed calls: every gguf and torch path writes x @ W.T into one kept output
    (no 32 MiB allocation per call in the timing), and int8_gemm computes its own product."""
    from tidal.kernels.bench_gguf import paths

    w = random_blocks(int(Q.Q8_0), 24, 64)
    x = torch.randn(3, 64)
    wf = gg.dequantize_rows(w, 0, w.rows)
    ref = x.double() @ wf.double().T
    codes = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    scales = torch.rand(24, 2) * 1e-2
    found = paths(x, w, (wf, codes, scales), ISAS)
    outs = {label: fn() for label, fn, _ in found}
    kept = [outs[label] for label in outs if label != "int8_gemm"]
    assert len(kept) == 2 * len(ISAS) + 1 and all(o is kept[0] for o in kept)
    for label, fn, _ in found:
        if label != "int8_gemm":
            # int8 activations round x to 1/254 of each 32 values' largest
            tol = 0.02 * float(ref.abs().max()) if " q8 " in label else 1e-4
            torch.testing.assert_close(fn().double(), ref, atol=tol, rtol=0.0, msg=label)
    lib8 = outs["int8_gemm"]
    if lib8 is not None:
        w8 = codes.float() * scales.repeat_interleave(32, dim=1)
        torch.testing.assert_close(lib8, x @ w8.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_jobs_give_each_row_the_bits_of_its_own_call(isa: str) -> None:
    """gguf_gemm_jobs (a MoE step's experts in one call): each job's rows of x (gathered, repeats
    allowed), its segments side by side, equal to gguf_gemm on the same rows; a None job's rows
    and the columns past a narrower job are left as they were."""
    k = 512
    experts = [gg.BlockSegments((weight(Q.Q4_K, 40, k, seed=e), weight(Q.Q4_K, 40, k, seed=9 + e)))
               for e in range(3)]  # fmt: skip
    downs = [gg.BlockSegments((weight(t, n, k, seed=20 + i),))
             for i, (t, n) in enumerate([(Q.Q5_0, 24), (Q.Q8_0, 33), (Q.Q6_K, 17), (Q.IQ4_XS, 5)])]  # fmt: skip
    torch.manual_seed(5)
    x = torch.randn(9, k)
    for jobs, counts, rows in [
        (experts, [1, 3, 7], [4, 0, 4, 8, 0, 1, 2, 3, 5, 6, 7]),
        ([experts[2], None, experts[0]], [2, 2, 1], [8, 8, 1, 2, 0]),
        (downs, [2, 1, 12, 1], [3, 5, 0, *range(9), 1, 2, 3, 7]),
    ]:
        index = torch.tensor(rows)
        width = max(j.rows for j in jobs if j is not None) + 3
        out = torch.full((len(rows), width), -1.0)
        assert gg.gguf_gemm_jobs(x, jobs, counts, index, isa, out=out) is out
        start = 0
        for job, n in zip(jobs, counts, strict=True):
            got = out[start : start + n]
            if job is None:
                assert (got == -1).all()
            else:
                alone = gg.gguf_gemm(x[index[start : start + n]], job, "q8", isa)
                assert torch.equal(got[:, : job.rows], alone)
                assert (got[:, job.rows :] == -1).all()
            start += n
    fresh = gg.gguf_gemm_jobs(x, downs[:2], [1, 1], torch.tensor([0, 1]), isa)
    assert fresh is not None and fresh.shape == (2, 33)
    with pytest.raises(ValueError, match="rows"):
        gg.gguf_gemm_jobs(x, downs[:1], [2], torch.tensor([0]), isa)
    with pytest.raises(ValueError, match="K=256"):
        gg.gguf_gemm_jobs(torch.randn(2, 256), downs[:1], [1], torch.tensor([0]), isa)
    with pytest.raises(RuntimeError, match="bad shape"):
        gg.gguf_gemm_jobs(x, downs[:1], [1], torch.tensor([9]), isa)  # past x's rows
