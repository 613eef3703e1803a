"""KVCacheManager with one full-attention group: exact block ids, LRU, TTL, prefix hits."""

from __future__ import annotations

import pytest

from tests.kv.pool_check import FakeClock, assert_pool_clean, make_request, step
from tidal.config.cache import CacheConfig
from tidal.kv.block_pool import BlockPool, num_blocks_for_budget
from tidal.kv.layout import KVLayout
from tidal.kv.manager import KVCacheManager

BS = 8


def full_layout() -> KVLayout:
    return KVLayout.from_layer_windows(
        [None], block_size=BS, num_kv_heads=1, head_dim=4, dtype_bytes=2
    )


def make_kv(num_blocks: int, clock: FakeClock | None = None, **config: object) -> KVCacheManager:
    return KVCacheManager(
        full_layout(),
        num_blocks,
        CacheConfig(block_size=BS, **config),
        clock=clock or FakeClock(),  # type: ignore[arg-type]
    )


def test_exact_ids_reuse_and_lru_eviction() -> None:
    kv = make_kv(8)
    a = make_request("a", list(range(20)))
    b = make_request("b", list(range(100, 109)))
    assert step(kv, a, 20) == [[1, 2, 3]]
    assert step(kv, b, 9) == [[4, 5]]
    assert kv.num_free_blocks == 2
    assert kv.usage == pytest.approx(5 / 7)
    kv.free(a)  # 3 is partial (uncached, top of the unhashed stack); 2 then 1 become cached
    assert kv.num_free_blocks == 5
    c = make_request("c", list(range(200, 230)))
    # Unhashed blocks first, the most recently released on top (3, whose pages are resident,
    # before the never-used 6 and 7), then the LRU cached one.
    assert step(kv, c, 30) == [[3, 6, 7, 2]]
    assert kv.evictions_by_reason == {"lru": 1, "ttl": 0, "pressure": 0}
    again = make_request("a2", list(range(20)))
    assert kv.get_computed_blocks(again) == 8  # block 1 survived, block 2 was evicted
    for r in (b, c, again):
        kv.free(r)
    assert_pool_clean(kv)


def test_does_not_fit_allocates_nothing() -> None:
    kv = make_kv(5)
    a = make_request("a", list(range(20)))
    assert step(kv, a, 20) == [[1, 2, 3]]
    b = make_request("b", list(range(100, 109)))
    assert kv.allocate_slots(b, 9) is None
    assert kv.block_tables(b) == [[]]
    assert kv.num_free_blocks == 1
    assert step(kv, b, 8) == [[4]]
    assert kv.allocate_slots(b, 1) is None  # position 8 needs a second block
    kv.free(a)
    kv.free(b)
    assert_pool_clean(kv)


def test_decode_grows_one_block_at_a_boundary() -> None:
    kv = make_kv(8)
    a = make_request("a", list(range(8)))
    assert step(kv, a, 8) == [[1]]
    seen = []
    for token in range(10):
        a.output_token_ids.append(token)
        seen.append(step(kv, a, 1)[0])
    # positions 8..15 live in block 2, 16 and 17 in block 3
    assert seen[0] == [1, 2] and seen[7] == [1, 2] and seen[8] == [1, 2, 3] and seen[9] == [1, 2, 3]
    kv.free(a)
    assert_pool_clean(kv)


def test_lru_order_follows_release_order_and_hits_refresh() -> None:
    kv = make_kv(8)
    reqs = {
        name: make_request(name, list(range(base, base + 16)))
        for name, base in (("a", 0), ("b", 100), ("c", 200))
    }
    assert [step(kv, r, 16)[0] for r in reqs.values()] == [[1, 2], [3, 4], [5, 6]]
    for name in ("b", "a", "c"):  # free queue becomes 4 3 2 1 6 5 (tails first within a request)
        kv.free(reqs[name])
    d = make_request("d", list(range(300, 332)))
    assert step(kv, d, 32) == [[7, 4, 3, 2]]
    assert kv.evictions_by_reason["lru"] == 3
    probes = {
        name: make_request(f"{name}?", list(range(base, base + 16)) + [999])
        for name, base in (("a", 0), ("b", 100), ("c", 200))
    }
    assert [kv.peek_computed_tokens(p) for p in probes.values()] == [8, 0, 16]
    e = probes["c"]
    assert kv.get_computed_blocks(e) == 16
    assert step(kv, e, 1, 16) == [
        [5, 6, 1]
    ]  # the hit took 5 and 6 off the free queue; 1 is evicted
    assert kv.evictions_by_reason["lru"] == 4
    for r in (d, e, probes["a"], probes["b"]):
        kv.free(r)
    assert_pool_clean(kv)


def test_ttl_drops_idle_cached_blocks_with_a_fake_clock() -> None:
    clock = FakeClock(0.0)
    kv = make_kv(8, clock, prefix_ttl_s=300.0)
    a = make_request("a", list(range(16)))
    b = make_request("b", list(range(100, 116)))
    step(kv, a, 16)
    kv.free(a)
    clock.advance(100.0)
    step(kv, b, 16)
    kv.free(b)
    clock.now_s = 400.0  # a idle exactly 400 s, b idle 300 s: only strictly older than the TTL go
    assert kv.evict_expired() == 2
    assert kv.evictions_by_reason == {"lru": 0, "ttl": 2, "pressure": 0}
    assert kv.peek_computed_tokens(make_request("a?", list(range(17)))) == 0
    b2 = make_request("b2", list(range(100, 117)))
    assert kv.get_computed_blocks(b2) == 16
    step(kv, b2, 1, 16)  # a hit refreshes last use: now 400
    clock.now_s = 650.0
    kv.free(b2)  # released at 650
    clock.now_s = 950.0
    assert kv.evict_expired() == 0
    clock.now_s = 950.5
    assert kv.evict_expired() == 2  # the two full blocks; the partial third was never cached
    assert kv.pool.num_cached == 0
    assert_pool_clean(kv)


def test_next_turn_reuses_prompt_and_output_blocks() -> None:
    kv = make_kv(16)
    prompt = list(range(20))
    t1 = make_request("t1", prompt)
    assert step(kv, t1, 20) == [[1, 2, 3]]
    for token in (50, 51, 52, 53):  # each sampled token is computed by the next decode step
        t1.output_token_ids.append(token)
        step(kv, t1, 1)
    t1.output_token_ids.append(54)  # the last sampled token is never computed
    kv.free(t1)
    t2 = make_request("t2", prompt + [50, 51, 52, 53, 54] + [60, 61, 62])
    assert (
        kv.get_computed_blocks(t2) == 24
    )  # positions 16..23 = prompt[16:20] + 50..53 form block 3
    assert step(kv, t2, 4, 24) == [[1, 2, 3, 4]]
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (28, 24)
    kv.free(t2)
    assert_pool_clean(kv)


def test_shared_system_prompt_is_shared_by_reference() -> None:
    kv = make_kv(16)
    system = list(range(500, 516))
    a = make_request("a", system + [1000, 1001, 1002])
    b = make_request("b", system + [2000, 2001, 2002, 2003, 2004])
    assert kv.get_computed_blocks(a) == 0
    assert step(kv, a, 19) == [[1, 2, 3]]
    assert kv.get_computed_blocks(b) == 16
    assert kv.get_computed_blocks(b) == 16  # asked again while waiting: counted once
    assert step(kv, b, 5, 16) == [[1, 2, 4]]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (19 + 21, 16)
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(b)
    assert_pool_clean(kv)


def test_n_siblings_share_the_prompt_in_the_same_step() -> None:
    kv = make_kv(16)
    siblings = [make_request(f"s{i}", list(range(20))) for i in range(3)]
    tables = []
    for s in siblings:  # admitted one after the other within one step
        cached = kv.get_computed_blocks(s)
        tables.append(step(kv, s, 20 - cached, cached))
    assert tables == [[[1, 2, 3]], [[1, 2, 4]], [[1, 2, 5]]]
    assert kv.pool.blocks[1].ref_cnt == 3
    for s in siblings:
        kv.free(s)
    assert_pool_clean(kv)


def test_never_the_whole_prompt_is_a_hit() -> None:
    kv = make_kv(8)
    a = make_request("a", list(range(16)))
    step(kv, a, 16)
    kv.free(a)
    same = make_request("same", list(range(16)))
    assert kv.get_computed_blocks(same) == 8  # the last token must be computed for its logits
    # The last block is recomputed into a never-used block; cached 2 keeps that content's hash.
    assert step(kv, same, 8, 8) == [[1, 3]]
    assert kv.pool.blocks[3].hash_key is None and kv.pool.blocks[2].hash_key is not None
    kv.free(same)
    assert_pool_clean(kv)


def test_prefix_caching_off_registers_and_hits_nothing() -> None:
    kv = make_kv(8, enable_prefix_caching=False)
    a = make_request("a", list(range(16)))
    step(kv, a, 16)
    kv.free(a)
    assert kv.pool.num_cached == 0
    b = make_request("b", list(range(17)))
    assert kv.get_computed_blocks(b) == 0
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (0, 0)
    kv.free(b)
    assert_pool_clean(kv)


def test_session_blocks_outlive_anonymous_ones() -> None:
    kv = make_kv(7, session_turns=1)
    n = make_request("anon", list(range(16)))
    s0 = make_request("s0", list(range(100, 116)), session_id="s")
    s1 = make_request("s1", list(range(200, 216)), session_id="s")
    for r in (n, s0, s1):
        step(kv, r, 16)
        kv.free(r)
    # anonymous 2 1 | session turn 0 (stale with session_turns=1): 4 3 | turn 1 (kept): 6 5
    x = make_request("x", list(range(300, 324)))
    assert step(kv, x, 24) == [[2, 1, 4]]
    assert kv.evictions_by_reason == {"lru": 3, "ttl": 0, "pressure": 0}
    assert kv.peek_computed_tokens(make_request("s1?", list(range(200, 217)))) == 16
    y = make_request("y", list(range(400, 424)))
    assert step(kv, y, 24) == [[3, 6, 5]]
    assert kv.evictions_by_reason == {"lru": 4, "ttl": 0, "pressure": 2}
    kv.free(x)
    kv.free(y)
    assert_pool_clean(kv)


def test_session_bookkeeping_forgets_sessions_without_blocks(monkeypatch) -> None:
    """Every session id ever seen used to stay in the manager; sessions whose blocks are gone
    (and with no live request) are forgotten, those still holding blocks keep their turns."""
    from tidal.kv import manager

    monkeypatch.setattr(manager, "SESSION_PRUNE_MIN", 4)
    kv = make_kv(5, session_turns=1)
    kept = make_request("kept-0", list(range(100, 108)), session_id="kept")
    step(kv, kept, 8)
    kv.free(kept)  # block 1 cached for session "kept", turn 0
    for i in range(40):  # one-block sessions that evict each other (3 free blocks besides 1)
        r = make_request(f"r{i}", [1000 + i] * 4, session_id=f"s{i}")
        step(kv, r, 4)  # a partial block: uncached, so it holds no session after free
        kv.free(r)
    assert len(kv._sessions) < 8  # pruned as it grew, not 41
    assert "kept" in kv._sessions and kv.pool.latest_turn["kept"] == 0
    again = make_request("kept-1", list(range(100, 108)) + [5], session_id="kept")
    assert kv.get_computed_blocks(again) == 8  # its cached block is still found
    step(kv, again, 1, 8)
    assert kv._sessions["kept"][0] == 2  # turn numbering went on: this is turn 1
    kv.free(again)
    assert_pool_clean(kv)


def test_validation_and_sizing() -> None:
    kv = make_kv(8)
    a = make_request("a", list(range(20)))
    with pytest.raises(ValueError, match="num_cached_tokens=8 is invalid"):
        kv.allocate_slots(a, 4, 8)  # nothing is cached yet
    with pytest.raises(ValueError, match="multiple of 8"):
        kv.allocate_slots(a, 4, 3)
    with pytest.raises(ValueError, match="layout.block_size=8"):
        KVCacheManager(full_layout(), 8, CacheConfig(block_size=16))
    assert full_layout().page_bytes == 128
    assert num_blocks_for_budget(full_layout(), 1000) == 7
    with pytest.raises(ValueError, match="kv_bytes=255 is invalid"):
        num_blocks_for_budget(full_layout(), 255)
    kv.free(a)
    assert_pool_clean(kv)


def test_unhashed_blocks_are_reused_most_recent_first() -> None:
    """The unhashed free blocks are a stack: a released block (its pages resident) goes out
    again before a never-used one, so a steady load touches only the blocks it needs at once."""
    pool = BlockPool(8, FakeClock(), session_turns=0)
    assert pool.take(3) == [1, 2, 3]  # never-used ones in id order
    pool.release([2])
    pool.release([1])
    assert pool.take(3) == [1, 2, 4]
    seen: set[int] = set()
    for _ in range(20):
        ids = pool.take(2)
        seen.update(ids)
        pool.release(ids)
    assert seen == {5, 6}
