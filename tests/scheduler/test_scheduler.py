"""Scheduler policy: budget, decodes first, chunking, priorities, preemption, deadlines, window."""

from __future__ import annotations

from tests.kv.pool_check import FakeClock, assert_pool_clean
from tests.scheduler.fake_model import PagedFakeModel, reference_output, run_to_completion
from tidal.config.cache import CacheConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.kv.layout import KVLayout
from tidal.kv.manager import KVCacheManager
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler

BS = 8


def build(
    num_blocks: int = 64,
    windows: list[int | None] | None = None,
    clock: FakeClock | None = None,
    cache: dict[str, object] | None = None,
    **config: object,
) -> tuple[Scheduler, PagedFakeModel, FakeClock]:
    clock = clock or FakeClock()
    layout = KVLayout.from_layer_windows(
        windows or [None], block_size=BS, num_kv_heads=1, head_dim=4, dtype_bytes=2
    )
    cache_config = CacheConfig(block_size=BS, **(cache or {}))  # type: ignore[arg-type]
    kv = KVCacheManager(layout, num_blocks, cache_config, clock=clock)
    scheduler = Scheduler(SchedulerConfig(**config), cache_config, kv, clock=clock)  # type: ignore[arg-type]
    return scheduler, PagedFakeModel(layout), clock


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kwargs: object) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, list(prompt), params, arrival_time_s=0.0, **kwargs)  # type: ignore[arg-type]


def shape(out: object) -> list[tuple[str, int, int, bool]]:
    return [(s.request.request_id, s.start, s.num_tokens, s.sample) for s in out.scheduled]  # type: ignore[attr-defined]


def step(scheduler: Scheduler, model: PagedFakeModel):  # type: ignore[no-untyped-def]
    out = scheduler.schedule()
    scheduler.update_from_output(out, model.execute(out))
    return out


def test_chunked_prefill_splits_exactly_and_decodes_go_first() -> None:
    sched, model, _ = build(max_num_batched_tokens=10)
    a, b = req("a", range(4), max_tokens=8), req("b", range(10, 35), max_tokens=2)
    assert sched.add_request(a)
    assert shape(step(sched, model)) == [("a", 0, 4, True)]
    assert sched.add_request(b)
    assert shape(step(sched, model)) == [("a", 4, 1, True), ("b", 0, 9, False)]
    assert shape(step(sched, model)) == [("a", 5, 1, True), ("b", 9, 9, False)]
    out = step(sched, model)
    assert shape(out) == [("a", 6, 1, True), ("b", 18, 7, True)]
    assert (out.num_batched_tokens, out.token_budget) == (8, 10)
    assert sched.stats.num_decode_seqs == 1 and sched.stats.num_prefill_seqs == 1
    assert shape(step(sched, model)) == [("a", 7, 1, True), ("b", 25, 1, True)]
    run_to_completion(sched, model)
    assert a.output_token_ids == reference_output(a) and b.output_token_ids == reference_output(b)
    assert_pool_clean(sched.kv)


def test_chunking_off_waits_for_budget_and_runs_a_huge_prompt_alone() -> None:
    sched, model, _ = build(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a = req("a", range(4), max_tokens=3)
    big = req("big", range(100, 125), max_tokens=2)
    small = req("small", range(50, 52), max_tokens=1)
    sched.add_request(a)
    assert shape(step(sched, model)) == [("a", 0, 4, True)]
    sched.add_request(big)
    sched.add_request(small)  # shorter: goes first
    assert shape(step(sched, model)) == [("a", 4, 1, True), ("small", 0, 2, True)]
    assert shape(step(sched, model)) == [("a", 5, 1, True)]  # big waits; a finishes here
    out = step(sched, model)
    assert shape(out) == [("big", 0, 25, True)] and out.num_batched_tokens == 25
    run_to_completion(sched, model)
    assert big.output_token_ids == reference_output(big)
    assert_pool_clean(sched.kv)


def test_priority_then_aging_orders_admission() -> None:
    sched, model, clock = build(
        max_num_seqs=1, priority_aging_s=10.0, length_aging_tokens_per_s=0.0
    )
    low, high = (
        req("low", range(4), max_tokens=1),
        req("high", range(10, 14), max_tokens=1, priority=1),
    )
    sched.add_request(low)
    sched.add_request(high)
    assert [s.request.request_id for s in step(sched, model).scheduled] == ["high"]
    run_to_completion(sched, model)
    old = req("old", range(4), max_tokens=1)
    sched.add_request(old)
    clock.advance(25.0)  # two levels of aging: 0 + 2 > 1
    sched.add_request(req("new-high", range(20, 24), max_tokens=1, priority=1))
    assert [s.request.request_id for s in step(sched, model).scheduled] == ["old"]
    run_to_completion(sched, model)
    assert_pool_clean(sched.kv)


def test_shorter_uncached_work_first_with_length_aging() -> None:
    sched, model, clock = build(max_num_seqs=1, length_aging_tokens_per_s=1.0, priority_aging_s=1e9)
    sched.add_request(req("long", range(100), max_tokens=1))
    clock.advance(89.0)  # long: 100 - 89 = 11 > short's 10
    sched.add_request(req("short", range(200, 210), max_tokens=1))
    assert [s.request.request_id for s in step(sched, model).scheduled] == ["short"]
    clock.advance(10.0)
    sched.add_request(req("short2", range(300, 310), max_tokens=1))
    # long: 100 - 99 = 1 beats short2's 10
    assert [s.request.request_id for s in step(sched, model).scheduled] == ["long"]
    run_to_completion(sched, model)
    assert_pool_clean(sched.kv)


def test_preemption_takes_lowest_priority_newest_and_it_comes_back() -> None:
    # 4 usable blocks; three 8-token prompts take 3; each decode at position 8 needs a 2nd block.
    sched, model, _ = build(num_blocks=5)
    reqs = [req("a", range(8), priority=1), req("b", range(10, 18)), req("c", range(20, 28))]
    for r in reqs:
        sched.add_request(r)
    assert len(step(sched, model).scheduled) == 3
    out = step(sched, model)
    assert out.preempted_ids == ["c"]  # b and c share the lowest priority; c is newer
    assert shape(out) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert reqs[2].status is RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert reqs[2].num_preemptions == 1 and sched.stats.num_preempted == 1
    run_to_completion(sched, model)
    assert [r.output_token_ids for r in reqs] == [reference_output(r) for r in reqs]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_pool_clean(sched.kv)


def test_a_request_alone_that_cannot_fit_fails_instead_of_looping() -> None:
    sched, model, _ = build(num_blocks=4)  # 3 usable blocks = 24 tokens
    grows = req("grows", range(20), max_tokens=10)
    sched.add_request(grows)
    outputs = run_to_completion(sched, model)
    assert grows.status is RequestStatus.FINISHED_ERROR
    # The prefill samples token 20; decodes of positions 20..23 fit and sample 21..24.
    assert grows.output_token_ids == reference_output(grows)[:5]
    assert outputs[-1].finished == [grows]
    too_big = req("too-big", range(30))
    sched.add_request(too_big)
    assert (
        step(sched, model).finished == [too_big] and too_big.status is RequestStatus.FINISHED_ERROR
    )
    assert_pool_clean(sched.kv)


def test_deadlines_finish_and_free() -> None:
    sched, model, clock = build(max_num_seqs=1)
    running = req("running", range(8), max_tokens=50, deadline_s=5.0)
    queued = req("queued", range(10, 18), queue_deadline_s=2.0)
    sched.add_request(running)
    sched.add_request(queued)
    step(sched, model)
    clock.now_s = 2.5
    out = step(sched, model)
    assert out.finished == [queued] and queued.status is RequestStatus.FINISHED_DEADLINE
    clock.now_s = 5.5
    out = step(sched, model)
    assert out.finished == [running] and running.status is RequestStatus.FINISHED_DEADLINE
    assert out.is_empty and not sched.has_unfinished()
    assert_pool_clean(sched.kv)


def test_bounded_queue_rejects_and_reports() -> None:
    sched, model, _ = build(max_queue=2)
    rs = [req(f"r{i}", range(i, i + 4), max_tokens=1) for i in range(3)]
    assert [sched.add_request(r) for r in rs] == [True, True, False]
    assert rs[2].status is RequestStatus.FINISHED_REJECTED
    assert sched.num_waiting == 2
    out = step(sched, model)
    assert out.finished == [rs[2]] and len(out.scheduled) == 2
    run_to_completion(sched, model)
    assert_pool_clean(sched.kv)


def test_window_ms_gathers_prefills_by_the_injected_clock() -> None:
    sched, model, clock = build(window_ms=100.0, max_num_seqs=3)
    sched.add_request(req("a", range(4), max_tokens=2))
    assert step(sched, model).is_empty and sched.stats.hold_until_s == 0.1
    clock.now_s = 0.05
    sched.add_request(req("b", range(10, 14), max_tokens=2))
    assert step(sched, model).is_empty
    clock.now_s = 0.1
    assert [s.request.request_id for s in step(sched, model).scheduled] == ["a", "b"]
    assert sched.stats.hold_until_s is None
    sched.add_request(req("c", range(20, 24), max_tokens=2))  # something runs: no hold
    assert len(step(sched, model).scheduled) == 3
    run_to_completion(sched, model)
    # Enough waiting work to fill the step: no hold either.
    for i in range(3):
        sched.add_request(req(f"f{i}", range(30 + i, 34 + i), max_tokens=1))
    assert len(step(sched, model).scheduled) == 3
    assert_pool_clean(sched.kv)


def test_abort_and_stop_tokens() -> None:
    sched, model, _ = build()
    a = req("a", range(8), max_tokens=20)
    first = reference_output(req("x", range(8), max_tokens=3))
    b = req("b", range(8), max_tokens=20, eos_token_ids=frozenset({first[2]}))
    sched.add_request(a)
    sched.add_request(b)
    step(sched, model)
    assert sched.abort("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("a") is None
    run_to_completion(sched, model)
    assert b.status is RequestStatus.FINISHED_STOPPED and b.output_token_ids == first
    assert_pool_clean(sched.kv)


def test_prefix_hit_is_skipped_and_counted() -> None:
    sched, model, _ = build()
    system = list(range(40, 56))
    a = req("a", system + [1, 2, 3], max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched, model)
    b = req("b", system + [7, 8], max_tokens=2)
    sched.add_request(b)
    out = step(sched, model)
    assert shape(out) == [("b", 16, 2, True)]
    assert b.num_cached_tokens == 16 and sched.stats.prefix_hit_tokens == 16
    assert sched.stats.prefix_queried_tokens == 18
    run_to_completion(sched, model)
    assert b.output_token_ids == reference_output(b)
    assert_pool_clean(sched.kv)
