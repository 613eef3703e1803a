"""The paged-attention kernel, per ISA path the machine runs, against the torch reference backend
and a float64 naive reference; its 8-bit writes bit for bit against quantize_kv; and bit-exact
batch invariance (alone or batched, however chunked, whatever the thread count)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from tidal.attention.cpu_paged import CpuPagedAttention
from tidal.attention.kv_quant import (
    QuantizedKV,
    allocate_quantized_pool,
    dequantize_kv,
    quantize_kv,
)
from tidal.attention.metadata import build_metadata
from tidal.attention.torch_paged import TorchPagedAttention
from tidal.kernels import paged_attention as pa

pytestmark = pytest.mark.skipif(not pa.available(), reason="no C compiler: the reference runs")

ISAS = [pytest.param(isa, id=name) for name, isa in pa.ISA_NAMES.items() if isa in pa.isas()]
KV_FORMATS = ["f32", "bf16", "f16", "int8", "fp8"]
FLOAT_PAGES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# Max |kernel - reference| on these unit-variance inputs (outputs are averages of V rows):
# measured <= 2e-6 for float32 sums in another order (and a polynomial exp), any page format.
ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny problems gain nothing from a second thread on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> CpuPagedAttention:
    """The backend the layers use, on the ISA path `isa` (the test's parameter)."""
    isa = request.getfixturevalue("isa")
    monkeypatch.setattr(pa, "default_isa", lambda: isa)
    return CpuPagedAttention()


@dataclass
class Seq:
    """One sequence's q/k/v for every position, fixed up front: the same token carries the same
    values whichever step computes it."""

    q: torch.Tensor  # (L, H, D)
    k: torch.Tensor  # (L, KVH, D)
    v: torch.Tensor


def make_seqs(lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int = 0) -> list[Seq]:
    g = torch.Generator().manual_seed(seed)
    return [
        Seq(
            torch.randn(n, heads, dim, generator=g),
            torch.randn(n, kv_heads, dim, generator=g),
            torch.randn(n, kv_heads, dim, generator=g),
        )
        for n in lengths
    ]


class Pool:
    """One layer's K/V pages in a format, and a scattered block table per sequence."""

    def __init__(
        self, kv: str, lengths: list[int], block_size: int, kv_heads: int, dim: int, seed: int = 1
    ) -> None:
        blocks = [-(-n // block_size) for n in lengths]
        num_blocks = 1 + sum(blocks) + 3  # block 0 is the null block; 3 never used
        shape = (num_blocks, block_size, kv_heads, dim)
        if kv in ("int8", "fp8"):
            data, scale = allocate_quantized_pool(1, *shape, kv, "cpu")
            self.k: torch.Tensor | QuantizedKV = QuantizedKV(data[0, 0], scale[0, 0], kv)
            self.v: torch.Tensor | QuantizedKV = QuantizedKV(data[0, 1], scale[0, 1], kv)
        else:
            dtype = FLOAT_PAGES[kv]
            self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        ids = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.tables, at = [], 0
        for n in blocks:
            self.tables.append([ids[at : at + n].tolist()])
            at += n
        self.block_size = block_size


Work = list[tuple[int, int, int]]  # (sequence, first position, number of tokens) per sequence


def run_step(
    backend: CpuPagedAttention | TorchPagedAttention,
    pool: Pool,
    seqs: list[Seq],
    work: Work,
    window: int | None = None,
    softcap: float | None = None,
    scale: float = 0.25,
) -> list[torch.Tensor]:
    """One step computing `work`; each sequence's output rows (n, H, D)."""
    q = torch.cat([seqs[i].q[s : s + n] for i, s, n in work])
    k = torch.cat([seqs[i].k[s : s + n] for i, s, n in work])
    v = torch.cat([seqs[i].v[s : s + n] for i, s, n in work])
    meta = build_metadata(
        [n for _, _, n in work],
        [s + n for _, s, n in work],
        [pool.tables[i] for i, _, _ in work],
        pool.block_size,
        torch.device("cpu"),
    )
    out = backend.forward(q, k, v, pool.k, pool.v, meta, 0, window, scale, softcap)
    return list(out.split([n for _, _, n in work]))


def stored_values(x: torch.Tensor, kv: str) -> torch.Tensor:
    """x (L, KVH, D) as the pages hold it, in float64."""
    if kv in ("int8", "fp8"):
        data, scale = quantize_kv(x, kv)
        return dequantize_kv(data, scale, kv, torch.float64)
    return x.to(FLOAT_PAGES[kv]).double()


def naive(
    seq: Seq, kv: str, first: int, n: int, window: int | None, softcap: float | None, scale: float
) -> torch.Tensor:
    """float64 attention of positions first..first+n-1 over the stored keys: (n, H, D)."""
    heads, kv_heads = seq.q.shape[1], seq.k.shape[1]
    keys, vals = stored_values(seq.k, kv), stored_values(seq.v, kv)
    out = torch.empty(n, heads, seq.q.shape[2], dtype=torch.float64)
    for j in range(n):
        p = first + j
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(heads):
            g = h // (heads // kv_heads)
            s = (keys[lo : p + 1, g] @ seq.q[p, h].double()) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[j, h] = torch.softmax(s, 0) @ vals[lo : p + 1, g]
    return out


# Prefill chunks beside decodes, chunks starting mid-sequence, then decodes.
LENGTHS = [44, 12, 53]
SCHEDULE: list[Work] = [
    [(0, 0, 21), (1, 0, 9)],
    [(0, 21, 19), (1, 9, 1), (2, 0, 33)],
    [(0, 40, 1), (1, 10, 1), (2, 33, 18)],
    [(0, 41, 1), (1, 11, 1), (2, 51, 1)],
    [(0, 42, 2), (2, 52, 1)],
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (7, None), (None, 30.0)], ids=["full", "window7", "cap30"]
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(4, 1, 32), (4, 2, 24), (2, 2, 12)],  # GQA 4:1; GQA 2:1 with an 8-column tail; D % 8 != 0
    ids=["gqa4", "gqa2-d24", "mha-d12"],
)
def test_matches_reference_and_float64(
    kernel: CpuPagedAttention,
    isa: int,
    kv: str,
    block_size: int,
    window: int | None,
    softcap: float | None,
    heads: int,
    kv_heads: int,
    dim: int,
) -> None:
    seqs = make_seqs(LENGTHS, heads, kv_heads, dim)
    got_pool = Pool(kv, LENGTHS, block_size, kv_heads, dim)
    ref_pool = Pool(kv, LENGTHS, block_size, kv_heads, dim)
    reference = TorchPagedAttention()
    worst = 0.0
    for work in SCHEDULE:
        got = run_step(kernel, got_pool, seqs, work, window, softcap)
        ref = run_step(reference, ref_pool, seqs, work, window, softcap)
        for (i, s, n), o, r in zip(work, got, ref):
            exact = naive(seqs[i], kv, s, n, window, softcap, 0.25)
            worst = max(worst, float((o - r).abs().max()), float((o.double() - exact).abs().max()))
    print(f"isa={isa} kv={kv} bs={block_size} window={window} softcap={softcap}: max {worst:.1e}")
    assert worst < ATOL
    _assert_same_pages(got_pool, ref_pool)


def _assert_same_pages(a: Pool, b: Pool) -> None:
    """The kernel's writes are the reference's, bit for bit (8-bit codes and scales included)."""
    for x, y in ((a.k, b.k), (a.v, b.v)):
        if isinstance(x, QuantizedKV):
            assert isinstance(y, QuantizedKV)
            assert torch.equal(x.data, y.data) and torch.equal(x.scale, y.scale)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", ["f32", "int8"])
@pytest.mark.parametrize("window", [None, 100])
def test_gemma_shape_across_segments(
    kernel: CpuPagedAttention, isa: int, kv: str, window: int | None
) -> None:
    """Gemma 3 270M's heads (H=4, KVH=1, D=256), pages of 16, contexts past the kernel's
    256-key segments; with two threads, so a lone decode is split across them."""
    torch.set_num_threads(2)
    lengths = [300, 530]
    seqs = make_seqs(lengths, 4, 1, 256)
    got_pool, ref_pool = Pool(kv, lengths, 16, 1, 256), Pool(kv, lengths, 16, 1, 256)
    reference = TorchPagedAttention()
    schedule: list[Work] = [
        [(0, 0, 128), (1, 0, 260)],
        [(0, 128, 171), (1, 260, 269)],
        [(0, 299, 1), (1, 529, 1)],  # 2 tiles < 2 x 2 threads: segments in parallel
    ]
    for work in schedule:
        got = run_step(kernel, got_pool, seqs, work, window, None, 1 / 16)
        ref = run_step(reference, ref_pool, seqs, work, window, None, 1 / 16)
        for (i, s, n), o, r in zip(work, got, ref):
            exact = naive(seqs[i], kv, s, n, window, None, 1 / 16) if n < 200 else None
            diff = float((o - r).abs().max())
            if exact is not None:
                diff = max(diff, float((o.double() - exact).abs().max()))
            assert diff < ATOL, (work, i, diff)
    _assert_same_pages(got_pool, ref_pool)


# ---------------------------------------------------------------- writes


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", KV_FORMATS)
def test_writes_match_the_reference_bit_for_bit(
    kernel: CpuPagedAttention, isa: int, kv: str
) -> None:
    """Rows that probe the rounding: all zeros, exact halves of a code step (round half to
    even), e4m3 subnormals and a 1e6 outlier beside tiny values."""
    dim = 16
    rows = [
        torch.zeros(dim),
        torch.arange(dim, dtype=torch.float32) - 7.5,  # int8 codes land on .5 steps
        torch.linspace(-1, 1, dim) * 1e-3,
        torch.tensor([1e6] + [1e-3] * (dim - 1)),  # the rest round to zero or subnormals
        torch.randn(dim, generator=torch.Generator().manual_seed(5)) * 3,
        torch.tensor([448.0, -448.0, 0.5, 1.0 / 64, 1.0 / 512, 3.0 / 1024] + [0.0] * (dim - 6)),
    ]
    k = torch.stack(rows)[:, None, :]  # (6, 1, D)
    seq = Seq(torch.randn(len(rows), 2, dim), k, -k.flip(0))
    got_pool, ref_pool = Pool(kv, [len(rows)], 4, 1, dim), Pool(kv, [len(rows)], 4, 1, dim)
    run_step(kernel, got_pool, [seq], [(0, 0, len(rows))])
    run_step(TorchPagedAttention(), ref_pool, [seq], [(0, 0, len(rows))])
    _assert_same_pages(got_pool, ref_pool)


@pytest.mark.parametrize("isa", ISAS)
def test_float16_pages_round_and_saturate_as_torch(kernel: CpuPagedAttention, isa: int) -> None:
    """float16 pages: every finite float32 exponent, ties of the half's normal and subnormal
    steps, its smallest subnormal and largest finite value, and values past it (saturated to
    +-65504, infinities included), written by the kernel exactly as torch's clamp-and-convert
    writes them. (NaN payloads are not compared: F16C keeps some of their bits, torch does not.)"""
    dim = 16
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 0x7F800000, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    random = bits.view(torch.float32) * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    step = 2.0**-24  # the half's subnormal step; a normal one at 1.0 is 2**-10
    probes = torch.tensor(
        [
            0.0,
            -0.0,
            step,
            step / 2,
            3 * step / 2,
            5 * step / 2,
            step * 1023.5,
            2.0**-14,
            1 + 2.0**-11,
            1 + 3 * 2.0**-11,
            65504.0,
            65519.0,
            65520.0,
            1e6,
            float("inf"),
            -65520.0,
            float("-inf"),
            2049.0,
            2051.0,
            2.0**-25 * 1.0001,
        ]  # fmt: skip
    )
    x = torch.cat([random, probes, -probes])
    x = torch.cat([x, torch.zeros(-x.numel() % dim)]).reshape(-1, 1, dim)
    seq = Seq(torch.randn(x.shape[0], 2, dim, generator=g), x, x.flip(0))
    got_pool, ref_pool = (
        Pool("f16", [x.shape[0]], 16, 1, dim),
        Pool("f16", [x.shape[0]], 16, 1, dim),
    )
    run_step(kernel, got_pool, [seq], [(0, 0, x.shape[0])])
    run_step(TorchPagedAttention(), ref_pool, [seq], [(0, 0, x.shape[0])])
    _assert_same_pages(got_pool, ref_pool)
    stored = got_pool.k[got_pool.tables[0][0]].reshape(-1, dim)[: x.shape[0]]
    assert torch.isfinite(stored).all() and float(stored.abs().max()) == 65504.0


# ---------------------------------------------------------------- batch invariance


def _prefill(
    backend: CpuPagedAttention,
    pool: Pool,
    seqs: list[Seq],
    chunks: list[int],
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Sequence 0's prompt in chunks of these sizes, beside other sequences' steps when present;
    returns sequence 0's rows over all its positions."""
    rows, at = [], 0
    others = len(seqs) - 1
    for step, n in enumerate(chunks):
        work: Work = [(0, at, n)]
        for i in range(1, 1 + others):  # the others: a few tokens each step
            m = 1 + (step + i) % 3
            start = sum(1 + (s + i) % 3 for s in range(step))
            if start + m <= seqs[i].q.shape[0]:
                work.append((i, start, m))
        if step % 2:  # sequence 0 is not always first in the batch
            work = work[1:] + work[:1]
        out = run_step(backend, pool, seqs, work, window, softcap)
        rows.append(out[[w[0] for w in work].index(0)])
        at += n
    return torch.cat(rows)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", ["f32", "bf16", "f16", "int8", "fp8"])
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (40, 30.0)], ids=["full", "window40-cap30"]
)
def test_alone_or_batched_and_however_chunked_is_bit_identical(
    kernel: CpuPagedAttention, isa: int, kv: str, window: int | None, softcap: float | None
) -> None:
    """Sequence 0's every row (prefill rows, last prompt token, decodes) is bit-identical:
    one chunk alone; odd chunks beside 3 other sequences; one token a step (decode) beside them."""
    length, heads, dim = 300, 4, 32
    seqs = make_seqs([length, 90, 90, 90], heads, 1, dim)
    results = []
    for chunks, with_others in [
        ([length], False),
        ([7, 1, 100, 33, 159], True),
        ([1] * length, True),
    ]:
        pool = Pool(kv, [length, 90, 90, 90], 16, 1, dim)
        batch = seqs if with_others else seqs[:1]
        results.append(_prefill(kernel, pool, batch, chunks, window, softcap))
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], results[2])


@pytest.mark.parametrize("isa", ISAS)
def test_thread_count_and_split_segments_change_nothing(
    kernel: CpuPagedAttention, isa: int
) -> None:
    """A lone long decode (long enough for the kernel to take two threads) runs its key segments
    on separate threads and folds them; one thread runs them in turn. A 64-token chunk tiles its
    queries. Same bits either way."""
    lengths = [1100, 64]
    seqs = make_seqs(lengths, 4, 1, 256)
    outs = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        pool = Pool("f32", lengths, 16, 1, 256)
        run_step(kernel, pool, seqs, [(0, 0, 1099)])
        decode = run_step(kernel, pool, seqs, [(0, 1099, 1)])[0]
        chunk = run_step(kernel, pool, seqs, [(1, 0, 64)])[0]
        outs[threads] = (decode, chunk)
    assert torch.equal(outs[1][0], outs[2][0])
    assert torch.equal(outs[1][1], outs[2][1])


# ---------------------------------------------------------------- paths and dispatch


@pytest.mark.parametrize("isa", [p for p in ISAS if p.values[0] != pa.ISA_SCALAR])
def test_vector_paths_agree_with_scalar(isa: int) -> None:
    """Each vector path against the portable one on e4m3 pages with a soft-cap (their sums run
    in another order, to rounding); a head dim of 64 keeps AVX-512 on its own blocks."""
    lengths = [40, 70]
    seqs = make_seqs(lengths, 4, 1, 64)
    outs = []
    for path in (pa.ISA_SCALAR, isa):
        pool = Pool("fp8", lengths, 16, 1, 64)
        run_step(TorchPagedAttention(), pool, seqs, [(0, 0, 39), (1, 0, 69)])
        meta = build_metadata([1, 1], [40, 70], pool.tables, 16, torch.device("cpu"))
        q = torch.stack([seqs[0].q[39], seqs[1].q[69]])
        k = torch.stack([seqs[0].k[39], seqs[1].k[69]])
        v = torch.stack([seqs[0].v[39], seqs[1].v[69]])
        assert isinstance(pool.k, QuantizedKV) and isinstance(pool.v, QuantizedKV)
        tables = meta.groups[0]
        outs.append(
            pa.paged_attention(
                q, k, v, pool.k.data, pool.v.data, pool.k.scale, pool.v.scale, pa.KV_FP8,
                tables.slot_mapping, tables.block_tables, meta.seq_arrays, None, 0.125, 20.0,
                isa=path,
            )
        )  # fmt: skip
    assert float((outs[0] - outs[1]).abs().max()) < 1e-6


def test_inputs_the_kernel_cannot_take_run_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    seqs = make_seqs([20], 4, 1, 16)
    half = [Seq(s.q.half(), s.k.half(), s.v.half()) for s in seqs]
    a, b = Pool("f32", [20], 4, 1, 16), Pool("f32", [20], 4, 1, 16)
    for pool in (a, b):  # float16 pages and activations: not a kernel format
        assert isinstance(pool.k, torch.Tensor) and isinstance(pool.v, torch.Tensor)
        pool.k, pool.v = pool.k.half(), pool.v.half()
    got = run_step(CpuPagedAttention(), a, half, [(0, 0, 20)])[0]
    assert torch.equal(got, run_step(TorchPagedAttention(), b, half, [(0, 0, 20)])[0])

    monkeypatch.setattr(pa, "available", lambda: False)  # no compiler, or TIDAL_KERNELS=0
    a, b = Pool("f32", [20], 4, 1, 16), Pool("f32", [20], 4, 1, 16)
    got = run_step(CpuPagedAttention(), a, seqs, [(0, 0, 20)])[0]
    assert torch.equal(got, run_step(TorchPagedAttention(), b, seqs, [(0, 0, 20)])[0])


@pytest.mark.parametrize("isa", ISAS)
def test_column_slices_of_a_fused_qkv_read_in_place(kernel: CpuPagedAttention, isa: int) -> None:
    """q/k/v as column views of one (T, (H + 2 KVH) * D) projection output give the same bits."""
    heads, kv_heads, dim, n = 4, 2, 16, 9
    seq = make_seqs([n], heads, kv_heads, dim)[0]
    fused = torch.cat([seq.q.flatten(1), seq.k.flatten(1), seq.v.flatten(1)], dim=1)
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    views = Seq(q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim))
    assert not views.v.is_contiguous()
    a, b = Pool("int8", [n], 4, kv_heads, dim), Pool("int8", [n], 4, kv_heads, dim)
    got = run_step(kernel, a, [views], [(0, 0, n)])[0]
    assert torch.equal(got, run_step(kernel, b, [seq], [(0, 0, n)])[0])
    _assert_same_pages(a, b)


def test_bfloat16_activations_widen_and_narrow() -> None:
    seqs = [Seq(s.q.bfloat16(), s.k.bfloat16(), s.v.bfloat16()) for s in make_seqs([30], 4, 1, 32)]
    a, b = Pool("bf16", [30], 16, 1, 32), Pool("bf16", [30], 16, 1, 32)
    got = run_step(CpuPagedAttention(), a, seqs, [(0, 0, 30)])[0]
    ref = run_step(TorchPagedAttention(), b, seqs, [(0, 0, 30)])[0]
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref.float()).abs().max()) < 2e-2  # bfloat16's own rounding
    _assert_same_pages(a, b)


def test_profiler_sees_the_kernel_region() -> None:
    from torch.profiler import ProfilerActivity, profile

    seqs = make_seqs([10], 4, 1, 16)
    pool = Pool("f32", [10], 4, 1, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(CpuPagedAttention(), pool, seqs, [(0, 0, 10)])
    assert any(e.name == "tidal::paged_attention" for e in prof.events())


def test_isa_environment_lowers_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("TIDAL_KERNEL_ISA", "scalar")
        pa.default_isa.cache_clear()
        assert pa.default_isa() == pa.ISA_SCALAR
        # a ceiling: the best path at or below the one it names
        monkeypatch.setenv("TIDAL_KERNEL_ISA", "avx2")
        pa.default_isa.cache_clear()
        assert pa.default_isa() == min(max(pa.isas()), pa.ISA_AVX2)
        monkeypatch.setenv("TIDAL_KERNEL_ISA", "avx512")
        pa.default_isa.cache_clear()
        assert pa.default_isa() == max(pa.isas()) <= pa.ISA_AVX512
        monkeypatch.setenv("TIDAL_KERNEL_ISA", "neon")
        pa.default_isa.cache_clear()
        with pytest.raises(ValueError, match="TIDAL_KERNEL_ISA"):
            pa.default_isa()
        monkeypatch.delenv("TIDAL_KERNEL_ISA")
        pa.default_isa.cache_clear()
        assert pa.default_isa() == max(pa.isas())
    finally:
        pa.default_isa.cache_clear()


def test_metadata_carries_the_sequence_arrays_once() -> None:
    meta = build_metadata(
        [3, 1, 5], [3, 10, 7], [[[1]], [[2, 3]], [[4, 5]]], 8, torch.device("cpu")
    )
    assert meta.seq_arrays.dtype == torch.int32
    assert meta.seq_arrays.tolist() == [[0, 3, 4], [3, 1, 5], [3, 10, 7]]
