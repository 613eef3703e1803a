"""Prompt-lookup speculative decoding end to end on the tiny model: what a request asks for
(penalties, min_tokens, stop ids, logit bias, max_tokens, logprobs, seeds) holds with drafts as
without, and the runner keeps exactly the drafts its samples confirm."""

from __future__ import annotations

import torch

from tests.engine.engine_util import (
    make_engine,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    run_to_completion,
)
from tests.kv.pool_check import assert_pool_clean
from tidal.engine.stats import StepStats
from tidal.layers.sampler import SamplerOutput, SamplingRow
from tidal.request import Request
from tidal.sampling_params import SamplingParams
from tidal.scheduler.output import ScheduledRequest, SchedulerOutput
from tidal.worker.model_runner import ModelRunner, RunnerOutput

# A step price of 1,000 rows: every proposal is checked, whatever its sequence's record.
DRAFTS = dict(num_speculative_tokens=4, prompt_lookup_min=1, speculative_max_num_seqs=8,
              speculative_step_rows=1000.0)  # fmt: skip
NO_DRAFTS = dict(num_speculative_tokens=0)


def _run(model_dir, requests: dict[str, tuple[list[int], SamplingParams]], **kwargs):
    steps: list[StepStats] = []
    engine = make_engine(model_dir, on_step=steps.append, max_num_batched_tokens=64, **kwargs)
    for rid, (ids, params) in requests.items():
        assert engine.add_request(rid, ids, params)
    outs = run_to_completion(engine)
    assert_pool_clean(engine.kv)
    return outs, sum(s.num_draft_tokens for s in steps), sum(s.num_accepted_tokens for s in steps)


def test_every_sampling_field_holds_with_drafts(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    text = "the tide comes in, the tide goes out, the tide comes in, the tide goes"
    prompt = tok.encode(text)
    repeat = tok.encode(" the tide")
    greedy = dict(temperature=0, max_tokens=24, logprobs=2)
    requests = {
        "plain": (prompt, SamplingParams(**greedy, ignore_eos=True)),
        "penalties": (prompt, SamplingParams(**greedy, ignore_eos=True, repetition_penalty=1.3,
                                             frequency_penalty=0.4, presence_penalty=0.2)),
        "min-tokens": (prompt, SamplingParams(**greedy, min_tokens=20)),
        "stop-id": (prompt, SamplingParams(**greedy, stop_token_ids=[repeat[-1]])),
        "bias": (prompt, SamplingParams(**greedy, ignore_eos=True, logit_bias={repeat[0]: -5.0})),
        "short": (prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        "seeded": (prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)),
    }  # fmt: skip
    plain, _, _ = _run(tiny_model_dir, requests, **NO_DRAFTS)
    spec, drafted, accepted = _run(tiny_model_dir, requests, **DRAFTS)
    assert 0 < accepted < drafted
    for rid in requests:  # a seeded token's noise is its own (seed, index)'s: the same too
        a, b = plain[rid].outputs[0], spec[rid].outputs[0]
        assert a.token_ids == b.token_ids, rid
        assert a.finish_reason == b.finish_reason, rid
        for la, lb in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert la.keys() == lb.keys()
            for tid, lp in la.items():
                assert abs(lp.logprob - lb[tid].logprob) < 1e-4
    assert len(spec["short"].outputs[0].token_ids) == 3
    assert len(set(spec["seeded"].outputs[0].token_ids)) > 3  # really sampled


def _scheduled(rid: str, draft: list[int]) -> ScheduledRequest:
    req = Request(rid, [1, 2], SamplingParams(temperature=0, logprobs=1), 0.0)
    return ScheduledRequest(req, 1, 1 + len(draft), [[1]], True, draft_token_ids=draft)


def test_the_runner_keeps_drafts_up_to_the_first_its_samples_disagree_with():
    sched = SchedulerOutput(
        [_scheduled("a", [5, 6, 7]), _scheduled("b", []), _scheduled("c", [4, 4])]
    )
    # Rows: a checks 5, 6, 7 (+1 after), b has one row, c checks 4, 4 (+1).
    tokens = [5, 6, 9, 8, 3, 4, 4, 2]
    result = SamplerOutput(
        torch.tensor(tokens),
        logprobs=torch.arange(8, dtype=torch.float32),
        ranks=torch.ones(8, dtype=torch.long),
        top_ids=torch.tensor(tokens).unsqueeze(1),
        top_logprobs=torch.zeros(8, 1),
    )
    rows = [SamplingRow(s.request.sampling_params, [], []) for s in sched.scheduled for _ in range(1 + len(s.draft_token_ids))]  # fmt: skip
    out = RunnerOutput()
    ModelRunner._collect(sched, result, rows, out)
    # a: 5 and 6 kept, then the model said 9 where the draft said 7 (row 3, the 8, is unused).
    assert out.sampled == {"a": [5, 6, 9], "b": [3], "c": [4, 4, 2]}
    assert [lp.logprob for lp in out.logprobs["a"]] == [0.0, 1.0, 2.0]
    assert [lp.logprob for lp in out.logprobs["c"]] == [5.0, 6.0, 7.0]
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (5, 4)
