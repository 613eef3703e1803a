"""Same greedy outputs with or without chunking, preemption, prefix hits and sliding windows."""

from __future__ import annotations

import pytest

from tests.kv.pool_check import FakeClock, assert_pool_clean
from tests.scheduler.fake_model import (
    PagedFakeModel,
    next_token,
    reference_output,
    run_to_completion,
)
from tidal.config.cache import CacheConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.kv.layout import KVLayout
from tidal.kv.manager import KVCacheManager
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler

BS = 8
GEMMA_LIKE = [16] * 5 + [None]


def workload(model_next=next_token) -> list[Request]:  # type: ignore[no-untyped-def]
    """Shared system prompts, a two-turn chat, n=3 siblings and mixed priorities and lengths."""
    system = [(i * 13) % 97 for i in range(24)]
    turn1 = system + [1, 2, 3, 4, 5]
    turn1_out = reference_output(_req("probe", turn1, 6), model_next)
    reqs = [_req("turn1", turn1, 6, session_id="chat")]
    reqs.append(_req("turn2", turn1 + turn1_out + [9, 9, 9], 5, session_id="chat"))
    reqs += [_req(f"sib{i}", system + [60, 61], 7) for i in range(3)]
    reqs += [
        _req(f"r{i}", [(i * 31 + j) % 100 for j in range(5 + 9 * i)], 3 + i, priority=i % 2)
        for i in range(6)
    ]
    reqs.append(_req("long", [(j * 3) % 100 for j in range(70)], 4))
    return reqs


def _req(rid: str, prompt: list[int], max_tokens: int, **kwargs: object) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, prompt, params, arrival_time_s=0.0, **kwargs)  # type: ignore[arg-type]


CASES = {
    "roomy": dict(num_blocks=256),
    "chunking-off": dict(num_blocks=256, enable_chunked_prefill=False),
    "tiny-budget": dict(num_blocks=256, max_num_batched_tokens=5),
    "preempting": dict(num_blocks=20),
    "prefix-off-preempting": dict(num_blocks=20, enable_prefix_caching=False),
    "gemma-like-roomy": dict(num_blocks=512, windows=GEMMA_LIKE),
    "gemma-like-preempting": dict(num_blocks=80, windows=GEMMA_LIKE, max_num_batched_tokens=16),
}
# With drafts the copying model's requests finish in fewer steps, so fewer run at once: smaller
# pools make them preempt.
DRAFT_BLOCKS = {"preempting": 14, "prefix-off-preempting": 12, "gemma-like-preempting": 44}


def copying_next_token(context: list[int]) -> int:
    """A model that mostly repeats what came 6 tokens back (so prompt-lookup drafts are often
    right) and sometimes does not (so some are rejected and their KV must be recomputed)."""
    if sum(context) % 4:
        return context[-6] if len(context) >= 6 else context[-1]
    return next_token(context)


# (drafts, speculative_step_rows): none; every proposal checked (a price of 1,000 rows); and
# DraftPlanner's own choice at the default price, which checks some and watches the others.
@pytest.mark.parametrize(
    "drafts,step_rows", [(0, 8.0), (3, 1000.0), (3, 8.0)], ids=["plain", "drafts", "planned"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_match_the_reference(case: str, drafts: int, step_rows: float) -> None:
    opts = dict(CASES[case])
    windows = opts.pop("windows", [None])
    num_blocks = opts.pop("num_blocks")
    if drafts:
        num_blocks = DRAFT_BLOCKS.get(case, num_blocks)
    prefix = opts.pop("enable_prefix_caching", True)
    layout = KVLayout.from_layer_windows(
        windows, block_size=BS, num_kv_heads=1, head_dim=4, dtype_bytes=2
    )  # type: ignore[arg-type]
    clock = FakeClock()
    cache_config = CacheConfig(block_size=BS, enable_prefix_caching=prefix)  # type: ignore[arg-type]
    kv = KVCacheManager(layout, num_blocks, cache_config, clock=clock)  # type: ignore[arg-type]
    spec = dict(num_speculative_tokens=drafts, prompt_lookup_min=1, prompt_lookup_max=3,
                speculative_max_num_seqs=8, speculative_step_rows=step_rows)  # fmt: skip
    config = SchedulerConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, **spec, **opts})  # type: ignore[arg-type]
    sched = Scheduler(config, cache_config, kv, clock=clock)
    model_next = copying_next_token if drafts else next_token
    model = PagedFakeModel(layout, model_next)
    reqs = workload(model_next)
    for r in reqs[:1]:
        sched.add_request(r)
    run_to_completion(sched, model)  # turn 1 completes before turn 2 arrives
    for r in reqs[1:]:
        sched.add_request(r)
    outputs = run_to_completion(sched, model)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH, r.request_id
        assert r.output_token_ids == reference_output(r, model_next), r.request_id
    preempted = sum(len(o.preempted_ids) for o in outputs)
    assert (preempted > 0) == case.endswith("preempting")
    if drafts:  # drafts were checked, and both kept and thrown away
        assert 0 < model.num_accepted_tokens < model.num_draft_tokens
    if prefix:
        assert kv.prefix_hit_tokens >= 24 + 2 * 24  # turn 2 and two siblings at least
        if num_blocks >= 256:  # nothing evicted: turn 2 reuses turn 1's prompt and outputs
            assert next(r for r in reqs if r.request_id == "turn2").num_cached_tokens == 32
    else:
        assert kv.prefix_hit_tokens == 0
    assert_pool_clean(kv)
