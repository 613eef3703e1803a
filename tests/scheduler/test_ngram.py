"""Prompt-lookup drafts: which tokens are proposed, and which decodes the scheduler gives them to."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.kv.pool_check import FakeClock
from tidal.config.cache import CacheConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.kv.layout import KVLayout
from tidal.kv.manager import KVCacheManager
from tidal.request import Request
from tidal.sampling_params import SamplingParams, StructuredOutputs
from tidal.scheduler.controller import BatchController
from tidal.scheduler.cost_model import StepShape
from tidal.scheduler.ngram import NgramProposer
from tidal.scheduler.scheduler import Scheduler, _shape


def test_the_longest_suffix_that_occurred_before_proposes_what_followed_it() -> None:
    p = NgramProposer(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]
    # Suffix (1, 2, 3) occurred at 1..3, followed by 9, 8, 2; (2, 3) later at 6..7 loses to it.
    assert p.propose("a", tokens, 3) == [9, 8, 2]
    assert p.propose("b", tokens, 10) == tokens[4:]  # no more than the sequence holds
    assert p.propose("c", [5, 1, 2, 3], 3) == []  # nothing occurred before
    assert p.propose("d", tokens, 0) == []


def test_the_latest_occurrence_wins_and_the_index_grows_with_the_tokens() -> None:
    p = NgramProposer(2, 2)
    tokens = [1, 2, 3, 4, 1, 2, 5, 6]
    assert p.propose("r", tokens, 2) == []  # (5, 6) never occurred before
    tokens += [1, 2]  # (1, 2) occurred at 0 and at 4: the later one is followed by 5, 6
    assert p.propose("r", tokens, 2) == [5, 6]
    tokens += [5, 6, 7, 1, 2]
    assert p.propose("r", tokens, 3) == [5, 6, 7]
    p.forget("r")
    assert p.propose("r", tokens, 3) == [5, 6, 7]  # rebuilt from scratch, same answer


def test_bad_lookup_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SchedulerConfig(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SchedulerConfig(num_speculative_tokens=-1)


def _scheduler(num_blocks: int = 64, **config: object) -> Scheduler:
    layout = KVLayout.from_layer_windows([None], block_size=8, num_kv_heads=1, head_dim=4, dtype_bytes=2)  # fmt: skip
    cache = CacheConfig(block_size=8)  # type: ignore[arg-type]
    kv = KVCacheManager(layout, num_blocks, cache, clock=FakeClock())  # type: ignore[arg-type]
    # A step price of 1,000 rows: every proposal is checked (DraftPlanner's choice is tested
    # in test_drafting.py).
    opts = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "speculative_step_rows": 1000.0}
    opts.update(config)
    return Scheduler(SchedulerConfig(**opts), cache, kv, clock=FakeClock())  # type: ignore[arg-type]


def _decoding(s: Scheduler, rid: str, prompt: list[int], **params: object) -> Request:
    """A request past its prefill, with one sampled token (7, which occurs in the prompt)."""
    req = Request(rid, prompt, SamplingParams(temperature=0, **params), arrival_time_s=0.0)  # type: ignore[arg-type]
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, {rid: [7]})
    return req


PROMPT = [7, 1, 2, 3, 4, 5, 6]


def test_a_decode_gets_drafts_within_max_tokens_and_the_budget() -> None:
    s = _scheduler()
    req = _decoding(s, "a", PROMPT, max_tokens=20)
    (sr,) = s.schedule().scheduled
    assert sr.draft_token_ids == [1, 2, 3, 4] and sr.num_tokens == 5 and sr.sample
    assert req.num_computed_tokens == len(PROMPT) + 1 + 4
    s2 = _scheduler()
    near_end = _decoding(s2, "b", PROMPT, max_tokens=3)  # 1 out, this step may emit 2 more
    assert s2.schedule().scheduled[0].draft_token_ids == [1]
    assert near_end.num_computed_tokens == len(PROMPT) + 2
    s3 = _scheduler()
    c, d = (Request(r, PROMPT, SamplingParams(temperature=0, max_tokens=20), 0.0) for r in "cd")
    s3.add_request(c)
    s3.add_request(d)
    s3.update_from_output(s3.schedule(), {"c": [7], "d": [7]})
    # Budget 3 for two decodes: the first gets the one token the second does not need.
    config = replace(s3.config, max_num_batched_tokens=3)
    s3.controller = BatchController(config)
    out = s3.schedule()
    assert [len(x.draft_token_ids) for x in out.scheduled] == [1, 0]
    assert out.num_batched_tokens == 3


def test_no_drafts_while_more_sequences_decode_than_speculative_max_num_seqs() -> None:
    for names, drafted in (("abc", False), ("ab", True)):
        s = _scheduler(speculative_max_num_seqs=2)
        reqs = [
            Request(r, PROMPT, SamplingParams(temperature=0, max_tokens=20), 0.0) for r in names
        ]
        for r in reqs:
            s.add_request(r)
        s.update_from_output(s.schedule(), {r.request_id: [7] for r in reqs})
        assert [bool(x.draft_token_ids) for x in s.schedule().scheduled] == [drafted] * len(names)


def test_lookup_indexes_go_once_more_than_twice_the_drafting_batch_hold_one() -> None:
    s = _scheduler(speculative_max_num_seqs=2)
    reqs = [Request(r, PROMPT, SamplingParams(temperature=0, max_tokens=20), 0.0) for r in "abcdef"]
    for r in reqs[:2]:
        s.add_request(r)
    s.update_from_output(s.schedule(), {r.request_id: [7] for r in reqs[:2]})
    out = s.schedule()  # two decode with drafts: two indexes
    assert s._drafter is not None and len(s._drafter.proposer) == 2
    s.update_from_output(out, {x.request.request_id: [1] for x in out.scheduled})
    for r in reqs[2:]:  # four more prefill, then six decode: no drafts, the two indexes stay
        s.add_request(r)
    s.update_from_output(s.schedule(), {r.request_id: [7] for r in reqs[2:]})
    out = s.schedule()
    assert not any(x.draft_token_ids for x in out.scheduled)
    assert len(s._drafter.proposer) == 2
    s.update_from_output(out, {x.request.request_id: [2] for x in out.scheduled})
    indexes = s._drafter.proposer._indexes
    indexes.update({f"gone-{i}": indexes["a"] for i in range(3)})
    s.schedule()  # five indexes > 2 x 2, and no drafts this step: all go
    assert len(s._drafter.proposer) == 0


def test_the_cost_model_counts_a_draft_as_a_decode_row() -> None:
    s = _scheduler()
    _decoding(s, "a", PROMPT, max_tokens=20)
    out = s.schedule()  # one decode with 4 drafts: five rows through the LM head and sampler
    assert _shape(out) == StepShape(0, 5, _shape(out).attended_keys)
    assert (s.stats.num_decode_seqs, s.stats.num_prefill_tokens) == (1, 0)


def test_rejected_drafts_are_computed_again() -> None:
    s = _scheduler()
    req = _decoding(s, "a", PROMPT, max_tokens=20)
    out = s.schedule()
    # The model kept drafts 1, 2 and then said 9 where the draft was 3.
    s.update_from_output(out, {"a": [1, 2, 9]})
    assert req.output_token_ids == [7, 1, 2, 9]
    assert req.num_computed_tokens == req.num_tokens - 1  # 9's KV is next step's
    (sr,) = s.schedule().scheduled
    assert sr.start == req.num_tokens - 1


def test_no_drafts_for_grammars_nor_past_the_context() -> None:
    s = _scheduler()
    json_spec = StructuredOutputs("json", '{"type": "object"}')
    _decoding(s, "a", PROMPT, max_tokens=20, structured_outputs=json_spec)
    assert s.schedule().scheduled[0].draft_token_ids == []
    s2 = _scheduler()
    req = Request("b", PROMPT, SamplingParams(temperature=0, max_tokens=20), 0.0, max_model_len=10)
    s2.add_request(req)
    s2.update_from_output(s2.schedule(), {"b": [7]})
    (sr,) = s2.schedule().scheduled  # 8 tokens known, 10 positions: 2 drafts at most
    assert sr.draft_token_ids == [1, 2]


def test_drafts_only_take_free_blocks() -> None:
    # 2 usable blocks of 8 tokens: "a" (8 tokens) holds one and "b" the other; a's drafts would
    # need a third. It decodes without them, and no one is preempted for a guess.
    s = _scheduler(num_blocks=3)
    a = Request("a", PROMPT, SamplingParams(temperature=0, max_tokens=20), 0.0)
    b = Request("b", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5), 0.0)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": [7], "b": [9]})
    assert s.kv.num_free_blocks == 0
    out = s.schedule()
    assert {x.request.request_id: x.draft_token_ids for x in out.scheduled} == {"a": [], "b": []}
    assert not out.preempted_ids and a.num_computed_tokens == a.num_tokens
