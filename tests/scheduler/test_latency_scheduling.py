"""The scheduler under the batch controller, with a fake clock and synthetic step costs: the TPOT
target holds under arriving load, the per-request chunk cap lets short prompts past a long one
without starving it, priorities decide who is capped, and outputs stay exact."""

from __future__ import annotations

from tests.kv.pool_check import FakeClock, assert_pool_clean
from tests.scheduler.fake_model import reference_output
from tests.scheduler.test_controller import true_cost
from tests.scheduler.test_scheduler import build, req, shape, step
from tidal.scheduler.scheduler import _shape


def test_a_waiting_short_prompt_caps_a_running_long_prefill() -> None:
    sched, model, clock = build(num_blocks=128, max_num_batched_tokens=64)
    long = req("long", range(200), max_tokens=2)
    sched.add_request(long)
    assert shape(step(sched, model)) == [("long", 0, 64, False)]
    sched.add_request(req("short", range(300, 310), max_tokens=2))
    # The short one outranks the long one's remaining 136 tokens: the long chunk is capped at
    # half the prefill budget and the short prompt comes in beside it.
    assert shape(step(sched, model)) == [("long", 64, 32, False), ("short", 0, 10, True)]
    assert shape(step(sched, model)) == [("short", 10, 1, True), ("long", 96, 63, False)]


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones() -> None:
    clock = FakeClock()
    sched, model, _ = build(num_blocks=256, clock=clock, max_num_batched_tokens=64, max_num_seqs=64)
    long = req("long", range(1000, 1600), max_tokens=1)
    sched.add_request(long)
    shorts = []
    for i in range(200):
        if long.is_finished:
            break
        short = req(f"s{i}", range(i, i + 24), max_tokens=1)
        sched.add_request(short)
        shorts.append(short)
        step(sched, model)
        clock.advance(0.1)
    # 600 tokens at 64 a step would take 10 steps alone; capped while it is outranked, it ages
    # (512 tokens of length per second waited) until it outranks the newcomers and runs in full.
    assert long.is_finished and len(shorts) < 30
    assert long.output_token_ids == reference_output(long)


def test_priority_decides_who_is_capped() -> None:
    sched, model, _ = build(num_blocks=128, max_num_batched_tokens=64)
    important = req("important", range(200), max_tokens=1, priority=5)
    sched.add_request(important)
    step(sched, model)
    sched.add_request(req("low", range(300, 310), max_tokens=1))
    # A low-priority waiter does not outrank the high-priority prefill: it takes what is left.
    assert shape(step(sched, model))[0] == ("important", 64, 64, False)
    sched2, model2, _ = build(num_blocks=128, max_num_batched_tokens=64)
    sched2.add_request(req("bulk", range(200), max_tokens=1))
    step(sched2, model2)
    sched2.add_request(req("urgent", range(300, 340), max_tokens=1, priority=5))
    assert shape(step(sched2, model2)) == [("bulk", 64, 32, False), ("urgent", 0, 32, False)]


def test_tpot_target_holds_under_arriving_load_with_exact_outputs() -> None:
    clock = FakeClock()
    sched, model, _ = build(
        num_blocks=1024,
        clock=clock,
        max_num_batched_tokens=2048,
        max_num_seqs=32,
        target_tpot_ms=150,
    )
    requests = [req(f"r{i}", range(i * 7, i * 7 + 300), max_tokens=40) for i in range(24)]
    arrivals = [i * 1.0 for i in range(len(requests))]  # one 300-token prompt a second
    decode_steps: list[float] = []
    budgets = set()
    finish_s: dict[str, float] = {}
    while sched.has_unfinished() or arrivals:
        while arrivals and arrivals[0] <= clock():
            arrivals.pop(0)
            sched.add_request(requests[len(requests) - len(arrivals) - 1])
        out = step(sched, model)
        step_s = true_cost(_shape(out)) if not out.is_empty else 0.05
        clock.advance(step_s)
        sched.record_step(out, step_s)
        budgets.add(out.token_budget)
        for r in requests:
            if r.is_finished and r.request_id not in finish_s:
                finish_s[r.request_id] = clock()
        if sched.stats.num_decode_seqs and len(decode_steps) < 10_000:
            decode_steps.append(step_s)
    # TPOT as SLOs read it: a request's mean seconds per output token after its first.
    # (The first token is stamped at the start of its step's clock, the last at the end.)
    tpots = sorted((finish_s[r.request_id] - r.first_token_time_s) / 39 for r in requests)
    assert tpots[int(0.9 * (len(tpots) - 1))] <= 1.2 * 0.150, tpots
    assert len(budgets) > 3  # the budget moved with the load
    for r in requests:
        assert r.output_token_ids == reference_output(r)
    assert_pool_clean(sched.kv)


def test_fixed_budget_without_target_is_unchanged() -> None:
    sched, model, _ = build(max_num_batched_tokens=10)
    sched.add_request(req("a", range(25), max_tokens=1))
    out = step(sched, model)
    assert out.token_budget == 10 and sched.stats.budget_reason == "fixed"
    assert sched.stats.seat_cap == sched.config.max_num_seqs
