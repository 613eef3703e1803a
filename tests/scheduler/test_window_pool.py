"""The sliding-window share of a pool sized in tokens: what the scheduler really holds stays inside it."""

from __future__ import annotations

import random

from tests.kv.pool_check import FakeClock, assert_pool_clean
from tests.scheduler.fake_model import PagedFakeModel, reference_output
from tidal.config.cache import CacheConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.kv.block_pool import num_blocks_for_tokens, sliding_window_blocks
from tidal.kv.layout import KVLayout
from tidal.kv.manager import KVCacheManager
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams
from tidal.scheduler.controller import BatchController, StepLoad, StepPlan
from tidal.scheduler.scheduler import Scheduler

BS = 8
W = 16
# One full and two sliding groups of one layer each.
WINDOWS: list[int | None] = [W, None, W]


def build(num_blocks: int, **config: object) -> tuple[Scheduler, KVCacheManager, PagedFakeModel]:
    layout = KVLayout.from_layer_windows(
        WINDOWS, block_size=BS, num_kv_heads=1, head_dim=4, dtype_bytes=2
    )
    cache = CacheConfig(block_size=BS)
    kv = KVCacheManager(layout, num_blocks, cache, clock=FakeClock())
    scheduler = Scheduler(SchedulerConfig(**config), cache, kv, clock=FakeClock())  # type: ignore[arg-type]
    return scheduler, kv, PagedFakeModel(layout)


def req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, arrival_time_s=0.0)


def test_sliding_groups_never_hold_more_than_their_bound() -> None:
    """Random arrivals, chunked prompts, shared prefixes and decodes: after every schedule()
    (the peak of the step, its chunks allocated) each sliding group's blocks in use stay within
    sliding_window_blocks, and every output is the reference's."""
    seqs, step_tokens = 4, 80
    bound = sliding_window_blocks(W, BS, seqs, step_tokens)
    scheduler, kv, model = build(2000, max_num_seqs=seqs, max_num_batched_tokens=step_tokens)
    rng = random.Random(7)
    pending, submitted = [], []
    for i in range(60):
        if submitted and rng.random() < 0.3:  # a shared prefix: a hit on full blocks
            base = rng.choice(submitted).prompt_token_ids
            prompt = base[: rng.randint(1, len(base))] + [rng.randrange(100) for _ in range(5)]
        else:
            prompt = [rng.randrange(100) for _ in range(rng.randint(1, 200))]
        r = req(f"r{i}", prompt, rng.randint(1, 24))
        submitted.append(r)
        pending.append(r)
    peak = [0, 0]
    for _ in range(5000):
        while pending and rng.random() < 0.4:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        for g in (1, 2):  # the sliding groups (full ones come first)
            in_use = {b for r in submitted for b in kv.block_tables(r)[g] if b != 0}
            peak[g - 1] = max(peak[g - 1], len(in_use))
            assert len(in_use) <= bound, (g, len(in_use), bound)
        scheduler.update_from_output(out, model.execute(out))
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in submitted)
    for r in submitted:
        assert r.output_token_ids == reference_output(r), r.request_id
    assert scheduler.num_preemptions_total == 0
    # The workload comes near the bound (a loose bound would pass anything).
    assert min(peak) >= bound - 2
    assert_pool_clean(kv)


class ScriptedBudgets(BatchController):
    """Each step's token budget from a list (the CPU's cost-model budget varies like this)."""

    def __init__(self, config: SchedulerConfig, budgets: list[int]) -> None:
        super().__init__(config, on_cpu=False)
        self.budgets = budgets

    def plan(self, load: StepLoad) -> StepPlan:
        budget = self.budgets.pop(0)
        return StepPlan(budget, self.config.max_num_seqs, budget - load.num_decodes, "fixed")


def test_a_request_left_out_of_a_step_gives_back_its_dead_window_blocks() -> None:
    """A step of 80 tokens runs A's chunk of 40 and admits B with 40; the next, of 40, has room
    only for A. B computes nothing then, but its window moved past most of its first chunk: it
    keeps only the pages of its last W - 1 tokens (kv/block_pool.py sliding_window_blocks
    counts on that), not the whole chunk's."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=80)
    layout = KVLayout.from_layer_windows(
        WINDOWS, block_size=BS, num_kv_heads=1, head_dim=4, dtype_bytes=2
    )
    cache = CacheConfig(block_size=BS)
    kv = KVCacheManager(layout, 200, cache, clock=FakeClock())
    # The first plan is the scheduler's initial one, made when it is built.
    controller = ScriptedBudgets(config, [80, 40, 80, 40] + [80] * 20)
    scheduler = Scheduler(config, cache, kv, clock=FakeClock(), controller=controller)
    model = PagedFakeModel(layout)
    rng = random.Random(5)
    a = req("a", [rng.randrange(100) for _ in range(160)], 1)
    b = req("b", [rng.randrange(100) for _ in range(60)], 1)
    scheduler.add_request(a)
    out = scheduler.schedule()  # A: 0..39
    scheduler.update_from_output(out, model.execute(out))
    scheduler.add_request(b)
    out = scheduler.schedule()  # A: 40..79, B: 0..39
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 40), ("b", 40)]
    assert [sum(x != 0 for x in t) for t in kv.block_tables(b)] == [5, 5, 5]
    scheduler.update_from_output(out, model.execute(out))
    out = scheduler.schedule()  # A only: 80..119
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    # B's next query is at 40 and sees keys 25..39: blocks 3 and 4 of its sliding groups.
    assert kv.block_tables(b)[1][:3] == kv.block_tables(b)[2][:3] == [0, 0, 0]
    assert [sum(x != 0 for x in t) for t in kv.block_tables(b)] == [5, 2, 2]
    scheduler.update_from_output(out, model.execute(out))
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.execute(out))
    for r in (a, b):
        assert r.output_token_ids == reference_output(r)
    assert_pool_clean(kv)


def test_tokens_sized_pool_holds_its_tokens_without_preemption() -> None:
    """max_num_seqs requests whose KV sums to N tokens, partial last pages included, all run
    at once in a pool of num_blocks_for_tokens(N): nobody is preempted or refused."""
    seqs, step_tokens = 4, 16
    # KV tokens = prompt + max_tokens - 1: 41 + 41 + 41 + 37 = 160, 23 full-group pages.
    shapes = [(30, 12), (30, 12), (30, 12), (26, 12)]
    n = sum(p + m - 1 for p, m in shapes)
    layout = KVLayout.from_layer_windows(
        WINDOWS, block_size=BS, num_kv_heads=1, head_dim=4, dtype_bytes=2
    )
    num_blocks = num_blocks_for_tokens(layout, n, seqs, step_tokens)
    # The sliding share is what bounds it: fewer blocks than N tokens in every group.
    assert num_blocks < 1 + len(WINDOWS) * (4 + (n - 4) // BS)
    scheduler, kv, model = build(num_blocks, max_num_seqs=seqs, max_num_batched_tokens=step_tokens)
    rng = random.Random(3)
    requests = [
        req(f"s{i}", [rng.randrange(100) for _ in range(p)], m) for i, (p, m) in enumerate(shapes)
    ]
    for r in requests:
        scheduler.add_request(r)
    for _ in range(1000):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        assert (
            not out.preempted_ids
            and not out.finished
            or all(r.status is RequestStatus.FINISHED_LENGTH for r in out.finished)
        )
        scheduler.update_from_output(out, model.execute(out))
    assert scheduler.num_preemptions_total == 0
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_output(r)
    assert_pool_clean(kv)
