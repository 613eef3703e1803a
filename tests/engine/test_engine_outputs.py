"""EngineCore outputs end to end on the tiny model: stop strings across tokens (never emitted,
not even in a streamed delta), stop token ids, echo scoring with prompt logprobs against the
model's own logits, and sampled-token logprobs that agree with prompt logprobs of the same text."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_util import (
    make_engine,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    run_to_completion,
)
from tests.kv.pool_check import assert_pool_clean
from tests.models.paged import PagedBatch
from tidal.engine.core import EngineCore
from tidal.engine.output import Logprob, RequestDelta, RequestOutput
from tidal.sampling_params import SamplingParams

TEXT = "The tide comes in and the tide goes out."
# With this seed the tiny model writes "\ufffdgingin\r\r..." (tokens "gin", "gin" early on).
SEED = 1


def _sampled(**kw: object) -> SamplingParams:
    kw = {"temperature": 0.7, "seed": SEED, "max_tokens": 24, "ignore_eos": True, **kw}
    return SamplingParams(**kw)  # type: ignore[arg-type]


def _stream(engine: EngineCore, rid: str, ids: list[int], params: SamplingParams):
    """Run one request with delta outputs; returns (list of delta texts, final output)."""
    assert engine.add_request(rid, ids, params, delta=True)
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            final = out
    assert final is not None and final.finished
    return deltas, final


def _boundary_stop(tok, token_ids: list[int], text: str) -> tuple[str, int, int]:
    """A stop string whose first occurrence in `text` straddles a token boundary.

    Returns (stop, index of its first char in text, number of tokens up to the one completing it).
    """
    for i in range(1, len(token_ids)):
        head = tok.decode(token_ids[:i])
        b = len(head)
        if not text.startswith(head) or b < 2 or b + 1 > len(text):
            continue
        stop = text[b - 2 : b + 1]  # two characters of token i-1's text, one of token i's
        if stop.isprintable() and "\ufffd" not in stop and text.find(stop) == b - 2:
            return stop, b - 2, i + 1
    raise AssertionError(f"no stop string straddles a token boundary in {text!r}")


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> EngineCore:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def free_run(engine) -> RequestOutput:
    out = run_to_completion_one(engine, "free", engine.tokenizer.encode(TEXT), _sampled())
    assert out.outputs[0].finish_reason == "length"
    return out


def run_to_completion_one(engine, rid, ids, params) -> RequestOutput:
    assert engine.add_request(rid, ids, params)
    return run_to_completion(engine)[rid]


# ---- stop strings and stop ids ----------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_never_emitted(engine, free_run, include):
    tok = engine.tokenizer
    full = free_run.outputs[0]
    stop, start, num_tokens = _boundary_stop(tok, full.token_ids, full.text)
    params = _sampled(stop=["never-seen-stop", stop], include_stop_str_in_output=include)
    deltas, final = _stream(engine, f"stop-{include}", tok.encode(TEXT), params)
    out = final.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # Same seed, same tokens, up to and including the one that completed the stop string.
    expected = full.text[: start + len(stop)] if include else full.text[:start]
    assert "".join(deltas) == expected
    if not include:
        assert all(stop not in "".join(deltas[: k + 1]) for k in range(len(deltas)))
    # The same request without deltas reports the kept tokens.
    whole = run_to_completion_one(engine, f"stop-whole-{include}", tok.encode(TEXT), params)
    assert whole.outputs[0].text == expected
    assert whole.outputs[0].token_ids == full.token_ids[:num_tokens]
    assert_pool_clean(engine.kv)


def test_stop_token_id_ends_the_output(engine, free_run):
    tok = engine.tokenizer
    full = free_run.outputs[0].token_ids
    # The first position whose token did not occur before it.
    pos = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    stop_id = full[pos]
    params = _sampled(stop_token_ids=[stop_id])
    out = run_to_completion_one(engine, "stop-id", tok.encode(TEXT), params).outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == full[: pos + 1]  # the stop token is kept, its text is not
    assert out.text == tok.decode(full[:pos])
    assert_pool_clean(engine.kv)


# ---- echo scoring and logprobs ----------------------------------------------------------------


def _reference_logprobs(engine: EngineCore, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) log_softmax of the model's logits, from the test paged runner."""
    batch = PagedBatch(engine.loaded.model, engine.loaded.arch, len(ids), 1, block_size=8)
    with torch.inference_mode():
        logits = batch.step([ids], [0], [0])
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_entry(entry: dict[int, Logprob], target: int, ref_row: torch.Tensor, k: int) -> None:
    """One position's logprobs: the target's value and rank, and the top-k ids and values."""
    ref_top = ref_row.topk(k)
    assert list(entry)[:k] == ref_top.indices.tolist()
    for tid, value in zip(ref_top.indices.tolist(), ref_top.values.tolist(), strict=True):
        assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
    assert entry[target].logprob == pytest.approx(float(ref_row[target]), abs=1e-4)
    assert entry[target].rank == int((ref_row > ref_row[target]).sum()) + 1


@pytest.mark.parametrize("budget", [1024, 16, 7])  # whole prompt, chunks on and off blocks
def test_echo_scoring_matches_the_model_logits(tiny_model_dir, budget):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    ids = engine.tokenizer.encode(TEXT + " Hello world! How are you today?")
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    out = run_to_completion_one(engine, "echo", ids, params)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None  # nothing predicts the first token
    ref = _reference_logprobs(engine, ids)
    for p in range(1, len(ids)):
        _assert_entry(out.prompt_logprobs[p], ids[p], ref[p - 1], k=3)
    assert_pool_clean(engine.kv)


def test_echo_scoring_after_the_prompt_was_cached(engine):
    """A cached prefix must not cost prompt logprobs: every position is still scored."""
    ids = engine.tokenizer.encode(TEXT + " A serving engine batches requests.")
    run_to_completion_one(engine, "warm", ids, SamplingParams(max_tokens=2))
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    out = run_to_completion_one(engine, "echo-cached", ids, params)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    ref = _reference_logprobs(engine, ids)
    for p in range(1, len(ids)):
        _assert_entry(out.prompt_logprobs[p], ids[p], ref[p - 1], k=2)


def test_sampled_logprobs_agree_with_prompt_logprobs_of_the_same_text(engine, tiny_model_dir):
    """Logprobs are the model's raw distribution: a sampled token's entry (temperature 0.7,
    its top alternatives) equals the echo-scoring entry of that token in prompt + output."""
    ids = engine.tokenizer.encode("Hello world! How are you today?")
    gen = run_to_completion_one(engine, "gen", ids, _sampled(logprobs=4, max_tokens=10))
    c = gen.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 10
    text = ids + c.token_ids
    params = SamplingParams(max_tokens=0, prompt_logprobs=4)
    # Scored without prefix caching (see the xfail above): every position is computed.
    plain = make_engine(tiny_model_dir, enable_prefix_caching=False)
    echo = run_to_completion_one(plain, "score", text, params)
    assert echo.prompt_logprobs is not None
    cumulative = 0.0
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        scored = echo.prompt_logprobs[len(ids) + i]
        assert scored is not None
        assert entry.keys() == scored.keys()
        assert list(entry)[:4] == list(scored)[:4]  # the top-4, best first
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(scored[tid].logprob, abs=1e-4)
            assert lp.rank == scored[tid].rank
            assert lp.decoded_token == engine.tokenizer.decode([tid], skip_special_tokens=False)
        cumulative += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(cumulative, abs=1e-5)
    assert_pool_clean(engine.kv)


def test_preempted_request_reports_each_prompt_logprob_once(tiny_model_dir):
    """Recompute after preemption runs the prompt again; its logprobs must not be added twice."""
    plain = make_engine(tiny_model_dir, enable_prefix_caching=False)
    # 33 blocks over the tiny gemma's 4 KV groups: three 21-token requests decoding 30 tokens
    # each do not fit together, so the newest is preempted.
    tight = make_engine(
        tiny_model_dir, kv_cache_bytes=33 * plain.layout.page_bytes, enable_prefix_caching=False
    )
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2, logprobs=2
    )
    prompts = {f"r{i}": [1] + list(range(10 + 30 * i, 30 + 30 * i)) for i in range(3)}
    for rid, ids in prompts.items():
        tight.add_request(rid, ids, params)
        plain.add_request(rid, ids, params)  # room for all three: never preempted
    outs = run_to_completion(tight)
    refs = run_to_completion(plain)
    assert [outs[r].metrics.num_preemptions for r in prompts] == [0, 0, 1]
    for rid, ids in prompts.items():
        ref, got = refs[rid], outs[rid]
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert got.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert len(got.prompt_logprobs) == len(ids)
        for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert_pool_clean(tight.kv)


# ---- streamed (delta) outputs -----------------------------------------------------------------


def test_a_streamed_request_sends_only_what_is_new(tiny_model_dir):
    """Each delta carries the step's new tokens and logprobs; the prompt's logprobs cross once,
    complete, on the first delta, even when the prefill is chunked; metrics ride along only
    until the first token and at the finish. Together they equal the full output."""
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8, max_num_seqs=4)
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 16  # three prefill chunks at least
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    assert engine.add_request("delta", ids, params, delta=True)
    deltas: list[RequestDelta] = []
    while engine.has_unfinished():
        deltas += engine.step()  # type: ignore[arg-type]
    full = run_to_completion_one(engine, "full", ids, params)

    assert all(isinstance(d, RequestDelta) for d in deltas)
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert deltas[0].prompt_logprobs == full.prompt_logprobs
    assert len(deltas[0].prompt_logprobs) == len(ids)
    outs = [d.outputs[0] for d in deltas]
    assert sum((o.token_ids for o in outs), []) == full.outputs[0].token_ids
    assert sum((o.logprobs or [] for o in outs), []) == full.outputs[0].logprobs
    assert "".join(o.text for o in outs) == full.outputs[0].text
    # A delta without new tokens brings the prompt's logprobs (the last chunk can be a
    # single token away from the first sample) or the finish, never a bare prefill chunk.
    assert all(o.token_ids or d.finished or d.prompt_logprobs for o, d in zip(outs, deltas))
    assert {d.num_prompt_tokens for d in deltas} == {len(ids)}
    first = next(i for i, o in enumerate(outs) if o.token_ids)
    with_metrics = [True] * (first + 1) + [False] * (len(deltas) - first - 2) + [True]
    assert [d.metrics is not None for d in deltas] == with_metrics
    assert deltas[-1].finished and deltas[-1].metrics.num_generation_tokens == 6
    assert all(d.last_token_time_s is not None for d in deltas[first:])
