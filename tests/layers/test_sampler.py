"""Sampler: each option on hand-made logits, seeded batch invariance, logprob normalization."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.kernels import sample as native_sample
from tidal.layers.sampler import Sampler, SamplingRow, make_generator, prompt_logprobs
from tidal.sampling_params import SamplingParams

V = 8


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def sampler_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on the C kernels' path (where this machine builds them) and on torch's."""
    monkeypatch.setattr(Sampler, "use_kernels", request.param == "kernel")
    return request.param


def _row(
    out: list[int] | None = None,
    prompt: list[int] | None = None,
    seed: int | None = None,
    eos: frozenset[int] = frozenset(),
    **kw: object,
) -> SamplingRow:
    params = SamplingParams(seed=seed, **kw)  # type: ignore[arg-type]
    gen = make_generator(seed, "cpu") if seed is not None else None
    return SamplingRow(params, list(prompt or []), list(out or []), gen, eos)


def _sampler(seed: int = 0) -> Sampler:
    s = Sampler(V, torch.device("cpu"))
    s.generator.manual_seed(seed)
    return s


def _draw_counts(logits: list[float], n: int, **kw: object) -> list[int]:
    # n draws of one row, in one batch of n identical unseeded rows.
    s = _sampler()
    out = s(torch.tensor([logits] * n), [_row(**kw) for _ in range(n)])
    return torch.bincount(out.token_ids, minlength=len(logits)).tolist()


def test_greedy_picks_argmax_and_breaks_ties_by_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 0, 0, 0, 0], [5.0] * 8, [-1.0] * 7 + [2.0]])
    out = _sampler()(logits, [_row(temperature=0.0) for _ in range(3)])
    assert out.token_ids.tolist() == [1, 0, 7]
    assert out.logprobs is None and out.top_ids is None


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(1, V + 4)
    logits[0, V + 1] = 100.0
    out = _sampler()(logits, [_row(temperature=0.0)])
    assert out.token_ids.tolist() == [0]


def test_top_k_never_yields_a_token_outside_the_k_best() -> None:
    counts = _draw_counts([3.0, 2.9, 2.8, 2.7, 0, 0, 0, 0], 1000, top_k=2)
    assert counts[2:] == [0] * 6
    assert counts[0] > 0 and counts[1] > 0


def test_top_k_larger_than_vocab_is_no_filter() -> None:
    counts = _draw_counts([1.0] * V, 800, top_k=1000)
    assert all(c > 0 for c in counts)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8).
    logits = [math.log(x) for x in (0.5, 0.3, 0.15, 0.05)] + [-math.inf] * 4
    counts = _draw_counts(logits, 1000, top_p=0.7)
    assert counts[2:] == [0] * 6 and counts[0] > 0 and counts[1] > 0
    # A tiny top_p still keeps the most likely token.
    assert _draw_counts(logits, 200, top_p=1e-9)[0] == 200


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    # probs relative to the best: 1, 0.6, 0.25, 0.05 -> min_p=0.3 keeps {0, 1}.
    logits = [math.log(x) for x in (1.0, 0.6, 0.25, 0.05)] + [-math.inf] * 4
    counts = _draw_counts(logits, 1000, min_p=0.3)
    assert counts[2:] == [0] * 6 and counts[1] > 0


def test_temperature_sampling_matches_the_softmax_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -math.inf, 1.5])
    for temperature in (1.0, 0.5):
        n = 20000
        counts = torch.tensor(_draw_counts(logits.tolist(), n, temperature=temperature))
        expected = torch.softmax(logits / temperature, dim=-1) * n
        live = expected > 0
        assert counts[~live].sum() == 0
        chi2 = (((counts[live] - expected[live]) ** 2) / expected[live]).sum().item()
        # 6 degrees of freedom: P(chi2 > 22.5) ~ 0.001; the draw is seeded so this never flakes.
        assert chi2 < 22.5, (temperature, chi2, counts.tolist())


def test_repetition_penalty_follows_hf_semantics() -> None:
    s = _sampler()
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0]])
    rows = [_row(prompt=[0, 1], out=[2], repetition_penalty=2.0)]
    got = s._apply_penalties(logits, rows)
    assert got.tolist() == [[1.0, -4.0, 0.5, -1.0, 0.5, 0.0, 0.0, 0.0]]


def test_presence_and_frequency_penalties_follow_openai_semantics() -> None:
    s = _sampler()
    logits = torch.zeros(2, V)
    rows = [
        _row(prompt=[5, 5], out=[1, 1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25),
        _row(prompt=[1], out=[1]),
    ]
    got = s._apply_penalties(logits, rows)
    want = [0.0] * V
    want[1] = -0.5 - 3 * 0.25
    want[3] = -0.5 - 0.25
    assert got[0].tolist() == want  # prompt tokens (5) are not penalized
    assert got[1].tolist() == [0.0] * V  # another row's penalties do not leak


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 0, 0, 0, 0]] * 4)
    rows = [
        _row(out=[], eos=frozenset({1}), min_tokens=2, stop_token_ids=[2], temperature=0.0),
        _row(out=[5, 5], eos=frozenset({1}), min_tokens=2, temperature=0.0),
        _row(out=[], eos=frozenset({1}), min_tokens=2, ignore_eos=True, temperature=0.0),
        _row(out=[], eos=frozenset({1}), min_tokens=1),
    ]
    out = _sampler()(logits, rows)
    assert out.token_ids.tolist()[:3] == [3, 1, 1]
    assert out.token_ids[3].item() != 1


def test_a_row_with_only_stop_tokens_finite_still_yields_a_token() -> None:
    logits = torch.full((1, V), -math.inf)
    logits[0, 1] = 0.0
    for temperature in (0.0, 1.0):
        rows = [_row(eos=frozenset({1}), min_tokens=3, temperature=temperature)]
        assert _sampler()(logits, rows).token_ids.tolist() == [1]
    all_inf = torch.full((1, V), -math.inf)
    assert _sampler()(all_inf, [_row(top_p=0.5)]).token_ids.item() in range(V)


def _run_batched(
    steps: list[torch.Tensor], kinds: list[dict], order: list[int]
) -> dict[int, list[int]]:
    # The rows `order` of each step's logits sampled as one batch: token ids per row index.
    s = _sampler(seed=len(order))
    rows = {i: _row(**kinds[i]) for i in order}  # fresh generators per run
    got: dict[int, list[int]] = {i: [] for i in order}
    for logits in steps:
        out = s(logits[order], [rows[i] for i in order])
        for j, i in enumerate(order):
            got[i].append(out.token_ids[j].item())
    return got


def test_seeded_rows_give_the_same_tokens_alone_and_in_any_batch() -> None:
    torch.manual_seed(1)
    steps = [torch.randn(7, V) for _ in range(6)]
    kinds = [
        dict(seed=7), dict(seed=8, top_k=3), dict(temperature=0.0), dict(), dict(seed=9),
        dict(seed=10, top_p=0.6), dict(seed=11, top_k=5, min_p=0.2, top_p=0.9),
    ]  # fmt: skip
    seeded = (0, 1, 4, 5, 6)

    def run(order: list[int]) -> dict[int, list[int]]:
        return _run_batched(steps, kinds, order)

    alone = {i: run([i])[i] for i in seeded}
    for order in ([0, 1, 2, 3, 4, 5, 6], [4, 3, 0], [1, 2, 4, 0], [6, 1, 5, 3], [5, 6]):
        batched = run(order)
        for i in seeded:
            if i in order:
                assert batched[i] == alone[i], (order, i)
    assert alone[0] != alone[4]


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_alternatives() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    rows = [
        _row(temperature=0.0, logprobs=3, repetition_penalty=5.0, prompt=[0, 1, 2]),
        _row(temperature=0.7, logprobs=1, seed=3),
        _row(temperature=0.0),
    ]
    out = _sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.ranks is not None
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (3, 3) and out.top_logprobs.shape == (3, 3)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, raw.topk(3).values)
    assert out.top_ids.tolist() == raw.topk(3).indices.tolist()
    torch.testing.assert_close(raw.exp().sum(-1), torch.ones(3))
    for b in range(3):
        expect_rank = 1 + int((raw[b] > raw[b, out.token_ids[b]]).sum())
        assert out.ranks[b].item() == expect_rank


def test_prompt_logprobs_shapes_and_values() -> None:
    torch.manual_seed(3)
    logits = torch.randn(600, V)  # more than one internal chunk
    targets = torch.randint(0, V, (600,))
    got = prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits.double(), dim=-1)  # float64, as the gate's scores need
    assert got.target_logprobs.dtype == got.top_logprobs.dtype == torch.float64
    assert got.target_logprobs.shape == (600,) and got.top_ids.shape == (600, 2)
    torch.testing.assert_close(got.target_logprobs, raw.gather(1, targets[:, None]).squeeze(1))
    torch.testing.assert_close(got.top_logprobs, raw.topk(2).values)
    assert got.target_ranks.tolist() == (1 + (raw > got.target_logprobs[:, None]).sum(-1)).tolist()
    empty = prompt_logprobs(logits[:0], targets[:0], 2)
    assert empty.top_ids.shape == (0, 2) and empty.target_logprobs.shape == (0,)


def test_mismatched_rows_raise() -> None:
    with pytest.raises(ValueError, match="rows"):
        _sampler()(torch.zeros(2, V), [_row()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_seeded_rows_are_batch_invariant_and_greedy_ties_pick_lowest_id() -> None:
    dev = torch.device("cuda")
    vocab = 32000
    torch.manual_seed(4)
    logits = torch.randn(4, vocab, device=dev)
    logits[3, 10] = logits[3, 20] = 100.0

    def rows() -> list[SamplingRow]:
        params = [SamplingParams(seed=5, top_p=0.9), SamplingParams(), SamplingParams(seed=6)]
        made = [
            SamplingRow(p, [1], [2], make_generator(p.seed, dev) if p.seed else None)
            for p in params
        ]
        return made + [SamplingRow(SamplingParams(temperature=0.0), [], [], None)]

    sampler = Sampler(vocab, dev)
    batched = [sampler(logits, rows()).token_ids.tolist() for _ in range(3)]
    alone = sampler(logits[:1], rows()[:1]).token_ids.item()
    assert all(b[0] == alone and b[3] == 10 for b in batched)


def test_seeded_draws_follow_the_filtered_distribution() -> None:
    # 4000 requests with their own seeds, one draw each: the exponential race is exact sampling.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0, 0.2])
    n = 4000
    rows = [_row(seed=s, top_k=6, temperature=0.8) for s in range(n)]
    out = _sampler()(logits.expand(n, V), rows)
    counts = torch.bincount(out.token_ids, minlength=V)
    kept = logits.topk(6).indices
    expected = torch.zeros(V)
    expected[kept] = torch.softmax(logits[kept] / 0.8, dim=-1) * n
    live = expected > 0
    assert counts[~live].sum() == 0
    chi2 = (((counts[live] - expected[live]) ** 2) / expected[live]).sum().item()
    assert chi2 < 20.5, (chi2, counts.tolist())  # 5 dof, P(chi2 > 20.5) ~ 0.001


def test_top_k_with_top_p_in_every_row_uses_only_the_k_best() -> None:
    # probs 0.4, 0.3, 0.2, 0.1: top_k=3 renormalizes to 4/9, 3/9, 2/9; top_p=0.7 keeps {0, 1}.
    logits = [math.log(x) for x in (0.4, 0.3, 0.2, 0.1)] + [-math.inf] * 4
    counts = _draw_counts(logits, 1000, top_k=3, top_p=0.7)
    assert counts[2:] == [0] * 6 and counts[0] > 0 and counts[1] > 0


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    s = _sampler()
    assert s(logits, [_row(temperature=0.0)]).token_ids.tolist() == [1]
    assert s(logits, [_row(temperature=0.0, logit_bias={1: -100.0})]).token_ids.tolist() == [2]
    assert s(logits, [_row(temperature=0.0, logit_bias={6: 100.0})]).token_ids.tolist() == [6]
    # Sampled rows cannot draw a banned token either: its probability is e^-100 of the rest.
    counts = _draw_counts(logits[0].tolist(), 2000, logit_bias={1: -100.0, 2: -100.0})
    assert counts[1] == 0 and counts[2] == 0 and sum(counts) == 2000


def test_logprobs_report_the_biased_distribution() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, V)
    bias = {3: 2.5, 0: -1.0}
    out = _sampler()(logits, [_row(temperature=0.0, logprobs=2, logit_bias=bias), _row(logprobs=2)])
    biased = logits[0].clone()
    for t, b in bias.items():
        biased[t] += b
    expect = torch.log_softmax(biased, dim=-1)
    assert out.top_logprobs is not None and out.logprobs is not None
    torch.testing.assert_close(out.top_logprobs[0], expect.topk(2).values)
    assert out.token_ids[0].item() == int(expect.argmax())
    torch.testing.assert_close(out.logprobs[0], expect[out.token_ids[0]])
    # The unbiased row beside it keeps the model's own distribution.
    raw = torch.log_softmax(logits[1], dim=-1)
    torch.testing.assert_close(out.top_logprobs[1], raw.topk(2).values)


def test_logit_bias_is_batch_invariant() -> None:
    torch.manual_seed(5)
    steps = [torch.randn(3, V) for _ in range(5)]
    kinds = [dict(seed=11, logit_bias={2: 3.0, 5: -2.0}), dict(temperature=0.0), dict(seed=12)]

    def run(order: list[int]) -> dict[int, list[int]]:
        return _run_batched(steps, kinds, order)

    alone = run([0])[0]
    assert run([0, 1, 2])[0] == alone and run([2, 0])[0] == alone
    assert run([1, 2])[2] == run([1, 0, 2])[2]  # an unbiased row ignores its biased neighbour


@pytest.mark.parametrize(
    "bias, message",
    [({-1: 1.0}, "token ids"), ({3: 100.5}, "[-100, 100]"), ({3: float("nan")}, "[-100, 100]"), ({True: 1.0}, "token ids")],
)  # fmt: skip
def test_logit_bias_out_of_range_is_refused(bias: dict, message: str) -> None:
    with pytest.raises(ValueError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias)
    assert message in str(e.value)


def test_unseeded_draws_reuse_one_scratch_and_release_it(sampler_path: str) -> None:
    """The inverse-CDF weights live in one buffer kept across steps (a fresh (R, V) tensor per
    step was page-faulted in every time); top-k draws only over the k candidates. The C
    kernels need no scratch at all."""
    s = _sampler()
    if sampler_path == "kernel" and native_sample.available():
        s(torch.randn(4, V), [_row(temperature=0.8, top_p=0.5) for _ in range(4)])
        assert s._weights is None
    s.use_kernels = False
    logits = torch.randn(4, V)
    rows = [_row(temperature=0.8) for _ in range(4)]
    s(logits, rows)
    first = s._weights
    assert first is not None and tuple(first.shape) == (4, V)
    s(logits[:3], rows[:3])
    assert s._weights is first  # fewer rows: a view of the same buffer
    s(logits, [_row(temperature=0.8, top_k=5) for _ in range(4)])
    assert tuple(s._weights.shape) == (4, 5)  # the candidates' width, not the vocabulary's
    s.release()
    assert s._weights is None
