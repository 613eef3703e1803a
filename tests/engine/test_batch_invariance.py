"""A request's greedy output is the same alone or among 16 concurrent requests of mixed lengths:
with or without prefix hits, chunked or not, preempted or not, and under priorities; for float
weights (a tiny HF model) and for a GGUF's own blocks through tidal's kernels (the CPU default)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import NamedTuple

import pytest

from tests.kv.pool_check import assert_pool_clean
from tests.loader.test_weight_cache import write_tiny_quantized_gemma
from tidal import LLM, SamplingParams
from tidal.engine.stats import StepStats
from tidal.scheduler.controller import BatchController, StepLoad, StepPlan

NUM_REQUESTS = 16
MAX_TOKENS = 12


class Model(NamedTuple):
    path: str
    vocab: int
    kv_dtype: str  # memory.kv_cache_dtype every engine of the test uses
    logprob_tol: float


# Logprobs alone vs batched. Float pages: 1e-4 (the float32 sums of prompt rows above 32 go
# through oneDNN, whose order follows the batch's shape: ~1e-7 relative). 16-bit pages round
# those keys and values, and a last-bit difference sometimes crosses a rounding boundary
# (float16's step is 2^-11 relative): measured up to 1.5e-4 here, bounded at 1e-3. The greedy
# tokens are compared exactly in every mode.
FLOAT_PAGES_TOL = 1e-4
HALF_PAGES_TOL = 1e-3


@pytest.fixture(scope="module", params=["hf-float", "gguf-blocks", "gguf-blocks-f32-pages"])
def model(request, tiny_model_dir, tmp_path_factory) -> Model:
    """The tiny HF model, or a tiny Gemma 3 GGUF in Q8_0, Q5_0, Q4_K and Q6_K blocks with a
    sliding window of 8, served from its blocks as by default (float16 pages), or with float32
    pages."""
    if request.param == "hf-float":
        return Model(str(tiny_model_dir), 320, "auto", FLOAT_PAGES_TOL)
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    if request.param == "gguf-blocks":
        return Model(str(path), 64, "auto", HALF_PAGES_TOL)
    return Model(str(path), 64, "float32", FLOAT_PAGES_TOL)


def _prompts(vocab: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [
        [1] + prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 50))]
        for _ in range(NUM_REQUESTS)
    ]


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def _run_alone(llm: LLM, prompts: list[list[int]]):
    return [llm.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0] for p in prompts]


def _assert_same(alone, batched, tol: float):
    for a, b in zip(alone, batched, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for tid, lp in la.items():
                assert abs(lp.logprob - lb[tid].logprob) < tol


@pytest.fixture(scope="module")
def reference(model):
    """Outputs of every request run alone, prefix caching off, one sequence at a time, without
    prompt-lookup drafts."""
    path, vocab = model.path, model.vocab
    llm = LLM(
        path,
        num_speculative_tokens=0,
        kv_cache_dtype=model.kv_dtype,
        kv_cache_bytes=8 << 20,
        block_size=8,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    return {
        seed: _run_alone(llm, _prompts(vocab, seed, shared_prefix=20 if seed else 0))
        for seed in (0, 1)
    }


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("batched", dict(kv_cache_bytes=8 << 20, max_num_seqs=16, max_num_batched_tokens=1024)),
        ("chunked", dict(kv_cache_bytes=8 << 20, max_num_seqs=16, max_num_batched_tokens=24)),
        (
            "unchunked",
            dict(
                kv_cache_bytes=8 << 20,
                max_num_seqs=16,
                max_num_batched_tokens=64,
                enable_chunked_prefill=False,
            ),
        ),
        # NOTE: a fixed step budget (the CPU's default one follows measured step times, so
        # whether the 16 requests preempt depended on the load), and a pool small enough to
        # preempt though each step first gives back every running request's out-of-window blocks.
        # No drafts: they finish the last requests in fewer steps, and the pool no longer
        # preempts (drafts under preemption: tests/scheduler/test_equivalence.py).
        (
            "preempted",
            dict(
                kv_cache_bytes=96 << 10,
                max_num_seqs=16,
                max_num_batched_tokens=256,
                cpu_budget_step_ms=None,
                num_speculative_tokens=0,
            ),
        ),
        # Prompt-lookup drafts (1-token suffixes: the random prompts repeat few longer ones):
        # each step checks up to 4 guessed tokens per decode in one batch with the others.
        (
            "speculative",
            dict(
                kv_cache_bytes=8 << 20,
                max_num_seqs=16,
                max_num_batched_tokens=64,
                num_speculative_tokens=4,
                prompt_lookup_min=1,
                speculative_max_num_seqs=16,
                speculative_step_rows=1000.0,  # every proposal checked, kept or not
            ),
        ),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])  # 1: all prompts share a 20-token prefix (prefix hits)
def test_batched_equals_alone(model, reference, name, kwargs, seed):
    path, vocab = model.path, model.vocab
    if name == "preempted" and vocab == 64:  # 16 KiB pages, sliding window 8: chunk to preempt
        pool = 200 << 10 if model.kv_dtype == "float32" else 100 << 10  # float16: 8 KiB pages
        kwargs = {**kwargs, "kv_cache_bytes": pool, "max_num_batched_tokens": 32}
    steps: list[StepStats] = []
    llm = LLM(path, block_size=8, kv_cache_dtype=model.kv_dtype, on_step=steps.append, **kwargs)
    prompts = _prompts(vocab, seed, shared_prefix=20 if seed else 0)
    priorities = [random.Random(seed).randrange(-2, 3) for _ in prompts]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, priority=priorities)
    _assert_same(reference[seed], outs, model.logprob_tol)
    stats = llm.engine.last_stats
    if name == "speculative":  # drafts were kept and thrown away, and the outputs held
        accepted = sum(s.num_accepted_tokens for s in steps)
        assert accepted > 0  # (the tiny GGUF repeats one token: all its drafts are right)
    if name == "preempted":
        assert stats.num_preemptions_total > 0
    if seed == 1 and name != "preempted":
        assert stats.prefix_hit_tokens_total >= 16 * (NUM_REQUESTS - 1)
    assert_pool_clean(llm.engine.kv)


def test_drafts_the_model_rejects_change_nothing(model, reference):
    """Prompts that hold the model's favourite token followed by others: a decode that writes
    it is given those others as drafts, which the model rejects (their KV is stale and must be
    written again). Outputs and logprobs equal those without drafts."""
    path, vocab = model.path, model.vocab
    outputs = [t for r in reference[0] for t in r.outputs[0].token_ids]
    fav = max(set(outputs), key=outputs.count)
    rng = random.Random(5)
    others = [t for t in range(3, vocab) if t != fav]
    prompts = [p + [fav, *rng.sample(others, 3)] + p[1:5] for p in _prompts(vocab, 2)]
    runs = []
    for drafts in (0, 4):
        steps: list[StepStats] = []
        llm = LLM(path, block_size=8, kv_cache_bytes=8 << 20, kv_cache_dtype=model.kv_dtype,
                  max_num_seqs=16, num_speculative_tokens=drafts, prompt_lookup_min=1,
                  speculative_max_num_seqs=16, speculative_step_rows=1000.0,
                  on_step=steps.append)  # fmt: skip
        runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS))
        assert_pool_clean(llm.engine.kv)
    drafted = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    assert 0 < accepted < drafted
    _assert_same(runs[0], runs[1], model.logprob_tol)


def test_prefix_hit_on_second_run_changes_nothing(model, reference):
    path, vocab = model.path, model.vocab
    llm = LLM(path, kv_cache_bytes=8 << 20, block_size=8, kv_cache_dtype=model.kv_dtype)
    prompts = _prompts(vocab, 0)
    first = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    hits_before = llm.engine.kv.prefix_hit_tokens
    second = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert llm.engine.kv.prefix_hit_tokens > hits_before
    _assert_same(reference[0], first, model.logprob_tol)
    _assert_same(reference[0], second, model.logprob_tol)
    assert_pool_clean(llm.engine.kv)


class _JitteredController(BatchController):
    """The real controller's plan, then a seeded random token budget and seat cap: the budget
    moves every step, as it does under a TPOT target on a busy machine."""

    def __init__(self, config, seed: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config)
        self.rng = random.Random(seed)
        self.budgets: list[tuple[int, int]] = []

    def plan(self, load: StepLoad) -> StepPlan:
        base = super().plan(load)
        budget = self.rng.randrange(1, 48)
        seats = self.rng.randrange(1, 17)
        self.budgets.append((budget, seats))
        return replace(base, token_budget=budget, max_num_seqs=seats, prefill_tokens=budget)


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_equals_alone_under_a_moving_budget(model, reference, seed):
    path, vocab = model.path, model.vocab
    steps: list[StepStats] = []
    llm = LLM(path, block_size=8, kv_cache_bytes=8 << 20, max_num_seqs=16, target_tpot_ms=50,
              kv_cache_dtype=model.kv_dtype,
              on_step=steps.append)  # fmt: skip
    scheduler = llm.engine.scheduler
    scheduler.controller = _JitteredController(scheduler.config, seed)
    prompts = _prompts(vocab, seed, shared_prefix=20 if seed else 0)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    _assert_same(reference[seed], outs, model.logprob_tol)
    assert len({b for b, _ in scheduler.controller.budgets}) > 10
    assert [s.token_budget for s in steps] == [b for b, _ in scheduler.controller.budgets]
    assert_pool_clean(llm.engine.kv)


def test_batched_equals_alone_under_the_real_tpot_controller(model, reference):
    """The controller as served: budgets from measured step times (so they differ run to run)."""
    path, vocab = model.path, model.vocab
    steps: list[StepStats] = []
    llm = LLM(path, block_size=8, kv_cache_bytes=8 << 20, max_num_seqs=16, target_tpot_ms=2,
              kv_cache_dtype=model.kv_dtype,
              target_ttft_ms=50, on_step=steps.append)  # fmt: skip
    outs = llm.generate(prompt_token_ids=_prompts(vocab, 0), sampling_params=PARAMS)
    _assert_same(reference[0], outs, model.logprob_tol)
    assert {s.budget_reason for s in steps} <= {
        "tpot",
        "tpot-slack",
        "tpot-bank",
        "ttft",
        "no-decodes",
    }
    assert_pool_clean(llm.engine.kv)
