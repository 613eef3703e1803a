"""The sampling kernels on every path this machine runs: draws against a float64 inverse CDF
(temperature, min-p, top-p, top-k candidates), the same token on every path and alone or in a
batch, log-sum-exp, top-k and rank counts against torch; odd widths, -inf, NaN, strided rows."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.kernels import sample

pytestmark = pytest.mark.skipif(not sample.available(), reason="no C compiler")
ISAS = sample.isas()
WIDTHS = [1, 7, 63, 64, 65, 1000, 4099]


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * scale
    x[0, max(1, vocab // 2) :] = float("-inf")  # a masked half
    if rows > 1:
        x[1, vocab - 1] = x[1].max() + 4.0  # the best token in the tail
    return x


def _reference_kept(x: torch.Tensor, temp: float, top_p: float, min_p: float) -> torch.Tensor:
    """The torch sampler's filter in float64: ids kept by top-p (on the whole distribution)
    then min-p, best first (stable: ties to the lower id)."""
    w = torch.softmax(x.double() / temp, dim=-1)
    probs, order = w.sort(descending=True, stable=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_p < 1.0:
        keep = (probs.cumsum(0) - probs) < top_p
        keep[0] = True
    keep &= probs >= min_p * probs[0]
    return order[keep]


def _interval(x: torch.Tensor, temp: float, min_p: float, token: int) -> tuple[float, float]:
    """[cdf before token, cdf through it] of the min-p-filtered softmax, ids in order, float64."""
    w = torch.softmax(x.double() / temp, dim=-1)
    w = torch.where(w >= min_p * w.max(), w, 0.0)
    cdf = w.cumsum(0) / w.sum()
    return (float(cdf[token - 1]) if token else 0.0), float(cdf[token])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", WIDTHS)
@pytest.mark.parametrize("temp, min_p", [(1.0, 0.0), (0.7, 0.0), (1.3, 0.05)])
def test_whole_rows_follow_the_inverse_cdf(isa: str, vocab: int, temp: float, min_p: float) -> None:
    x = _logits(6, vocab, vocab)
    u = torch.tensor([0.0, 0.3, 0.5, 0.77, 0.999, 0.123], dtype=torch.float64)
    got = sample.sample_rows(x, [temp] * 6, [1.0] * 6, [min_p] * 6, u, isa=isa)
    assert got is not None
    for b in range(6):
        lo, hi = _interval(x[b], temp, min_p, int(got[b]))
        assert lo - 1e-5 <= float(u[b]) <= hi + 1e-5, (b, int(got[b]), lo, hi)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab, scale", [(64, 3.0), (1000, 3.0), (4099, 1.0), (20000, 0.3)])
@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.0), (0.5, 0.0), (0.95, 0.01)])
def test_top_p_keeps_the_reference_nucleus(
    isa: str, vocab: int, scale: float, top_p: float, min_p: float
) -> None:
    """The draws stay inside the float64 nucleus (then min-p), and u -> 1 draws the nucleus's
    last (weakest) member, which pins the cut. The flat rows (scale 0.3, 1.0) take the histogram path (> 2,048
    candidates), the peaked ones the sorted one."""
    x = _logits(3, vocab, vocab)[1:]  # no masked row
    grid = torch.linspace(0, 1 - 1e-12, 257, dtype=torch.float64)
    for b in range(x.shape[0]):
        rows = [b] * grid.numel()
        n = len(rows)
        got = sample.sample_rows(x, [1.0] * n, [top_p] * n, [min_p] * n, grid, rows=rows, isa=isa)
        assert got is not None
        kept = _reference_kept(x[b], 1.0, top_p, min_p)
        assert set(got.tolist()) <= set(kept.tolist())
        if min_p == 0.0:  # (past a min-p cut the histogram path's last is not the weakest)
            assert int(got[-1]) == int(kept[-1])


@pytest.mark.parametrize("isa", ISAS)
def test_candidate_rows_apply_top_k_then_top_p_and_min_p(isa: str) -> None:
    x = _logits(4, 5000, 7)[1:]
    values, ids = x.topk(50, dim=-1)
    grid = torch.linspace(0, 1 - 1e-12, 101, dtype=torch.float64)
    for k, top_p, min_p in [(50, 1.0, 0.0), (10, 1.0, 0.0), (40, 0.8, 0.0), (30, 0.95, 0.1)]:
        for b in range(values.shape[0]):
            n = grid.numel()
            cols = sample.sample_rows(
                values[b : b + 1].expand(n, -1).contiguous(), [0.9] * n, [top_p] * n,
                [min_p] * n, grid, top_k=[k] * n, isa=isa,
            )  # fmt: skip
            assert cols is not None
            kept = _reference_kept(values[b, :k], 0.9, top_p, min_p)
            assert set(cols.tolist()) <= set(kept.tolist())
            assert int(cols[-1]) == int(kept[-1]) and int(cols[0]) == 0
            assert set(ids[b, cols].tolist()) <= set(ids[b, :k].tolist())


@pytest.mark.parametrize("vocab", [*WIDTHS, 262144])
def test_every_path_draws_the_same_token_alone_or_in_a_batch(vocab: int) -> None:
    x = _logits(5, vocab, vocab + 1)
    u = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(vocab))
    for top_p, min_p in [(1.0, 0.0), (0.9, 0.0), (1.0, 0.1), (0.6, 0.02)]:
        args = ([0.8] * 5, [top_p] * 5, [min_p] * 5, u)
        results = [sample.sample_rows(x, *args, isa=isa) for isa in ISAS]
        assert all(r is not None and torch.equal(r, results[0]) for r in results), (top_p, min_p)
        for b in range(5):
            alone = sample.sample_rows(x[b : b + 1], [0.8], [top_p], [min_p], u[b : b + 1])
            assert alone is not None and int(alone[0]) == int(results[0][b])


def test_every_path_draws_the_same_token_when_every_token_is_a_candidate() -> None:
    """A long flat tail just below top-p's last positive threshold (w < 2^-22) holding over 5%
    of the mass, so top_p 0.99 takes every token as a candidate (threshold 0, the histogram path):
    each path must pair every weight with its own id, in id order."""
    vocab = 262147  # not a multiple of 16: the paths' tails run too
    gen = torch.Generator().manual_seed(3)
    x = math.log(2.0**-22.1) + 0.05 * torch.randn(2, vocab, generator=gen)
    x[:, 0] = 0.0
    x[1, vocab // 3] = 0.0  # two peaks
    u = torch.linspace(0.9, 1 - 1e-9, 48, dtype=torch.float64)  # mostly past the peaks' mass
    rows = [b for b in range(2) for _ in range(u.numel())]
    args = ([1.0] * len(rows), [0.99] * len(rows), [0.0] * len(rows), u.repeat(2))
    results = [sample.sample_rows(x, *args, rows=rows, isa=isa) for isa in ISAS]
    assert all(r is not None and torch.equal(r, results[0]) for r in results)
    assert len(set(results[0].tolist())) > 20  # the tail is drawn, not only the peaks


@pytest.mark.parametrize("isa", ISAS)
def test_rows_without_a_usable_logit_draw_uniformly(isa: str) -> None:
    x = torch.randn(4, 100)
    x[0] = float("-inf")
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    u = torch.tensor([0.5, 0.25, 0.999, 0.0], dtype=torch.float64)
    got = sample.sample_rows(x, [1.0] * 4, [0.9] * 4, [0.0] * 4, u, isa=isa)
    assert got is not None and got[:3].tolist() == [50, 25, 99]


@pytest.mark.parametrize("isa", ISAS)
def test_strided_rows_and_row_selection(isa: str) -> None:
    wide = _logits(6, 1100, 5)
    x = wide[:, 5:1005]  # a padded vocabulary: row stride 1100
    u = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    args = ([0.8] * 3, [0.9] * 3, [0.0] * 3, u)
    picked = sample.sample_rows(x, *args, rows=[4, 1, 2], isa=isa)
    copied = sample.sample_rows(x[[4, 1, 2]].contiguous(), *args, isa=isa)
    assert picked is not None and copied is not None and torch.equal(picked, copied)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", [*WIDTHS, 262144])
def test_logsumexp_matches_torch(isa: str, vocab: int) -> None:
    x = _logits(4, vocab, vocab, scale=5.0)
    got = sample.logsumexp_rows(x, isa)
    assert got is not None
    torch.testing.assert_close(got, torch.logsumexp(x, dim=-1), rtol=2e-6, atol=2e-6)
    special = torch.zeros(3, 8)
    special[0] = float("-inf")
    special[1, 2] = float("nan")
    special[2, 3] = float("inf")
    edge = sample.logsumexp_rows(special, isa)
    assert (
        edge is not None
        and edge[0] == float("-inf")
        and edge[1].isnan()
        and edge[2] == float("inf")
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", [*WIDTHS, 262144])
def test_topk_and_count_match_torch(isa: str, vocab: int) -> None:
    x = _logits(4, vocab, vocab)
    k = min(vocab, 40)
    got = sample.topk_rows(x, k, isa=isa)
    assert got is not None
    values, ids = got
    ref_values, _ = x.topk(k, dim=-1)
    assert torch.equal(values, ref_values)
    assert torch.equal(x.gather(1, ids), values)  # ids point at their values
    for b in range(4):
        assert len(set(ids[b].tolist())) == k
    thr = x[:, 0]
    counts = sample.count_greater(x, thr, isa)
    assert counts is not None and torch.equal(counts, (x > thr[:, None]).sum(-1))


@pytest.mark.parametrize("isa", ISAS)
def test_topk_breaks_ties_to_the_lower_id_and_fills_masked_rows(isa: str) -> None:
    x = torch.zeros(2, 300)
    x[0, [3, 200, 17]] = 2.0
    x[1] = float("-inf")
    x[1, 250] = 1.0
    got = sample.topk_rows(x, 5, isa=isa)
    assert got is not None
    values, ids = got
    assert ids[0].tolist() == [3, 17, 200, 0, 1] and values[0].tolist() == [2, 2, 2, 0, 0]
    assert ids[1].tolist() == [250, 0, 1, 2, 3] and values[1, 0] == 1.0
    assert sample.topk_rows(x, sample.MAX_TOPK + 1) is None  # torch.topk takes those
