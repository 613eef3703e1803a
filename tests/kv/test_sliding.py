"""KVCacheManager with sliding-window groups: null entries, prefix hits and the Gemma 3 layout."""

from __future__ import annotations

from tests.kv.pool_check import FakeClock, assert_pool_clean, make_request, step
from tidal.config.cache import CacheConfig
from tidal.kv.layout import KVLayout
from tidal.kv.manager import KVCacheManager, num_skipped_blocks

BS = 8
W = 16


def make_kv(windows: list[int | None], num_blocks: int) -> KVCacheManager:
    layout = KVLayout.from_layer_windows(
        windows, block_size=BS, num_kv_heads=1, head_dim=4, dtype_bytes=2
    )
    return KVCacheManager(layout, num_blocks, CacheConfig(block_size=BS), clock=FakeClock())


def test_num_skipped_blocks_arithmetic() -> None:
    # A query at q sees keys q-W+1..q; block b is dead once (b+1)*bs <= q-W+1.
    assert [num_skipped_blocks(q, W, BS) for q in (0, 15, 22, 23, 30, 31, 39)] == [
        0,
        0,
        0,
        1,
        1,
        2,
        3,
    ]
    assert num_skipped_blocks(13, 8, 4) == 1  # the docstring's drawing


def test_null_entries_appear_exactly_when_the_window_passes() -> None:
    kv = make_kv([W, None], 32)  # group 0: full (layer 1), group 1: sliding (layer 0)
    assert [g.sliding_window for g in kv.layout.groups] == [None, W]
    a = make_request("a", list(range(20)))
    assert step(kv, a, 20) == [[1, 2, 3], [4, 5, 6]]
    sliding_by_pos = {}
    for pos in range(20, 32):
        a.output_token_ids.append(pos)
        sliding_by_pos[pos] = step(kv, a, 1)[1]  # the table used when position pos is computed
    assert sliding_by_pos[22] == [4, 5, 6]  # the query at 22 still sees key 7 in block 0
    assert sliding_by_pos[23] == [0, 5, 6]  # 23 sees 8..23: block 0 is dead
    assert sliding_by_pos[24] == [0, 5, 6, 8]  # full group took 7 for position 24
    assert sliding_by_pos[30] == [0, 5, 6, 8]
    assert sliding_by_pos[31] == [0, 0, 6, 8]
    assert kv.block_tables(a)[0] == [1, 2, 3, 7]
    # Released window blocks are full and hashed: idle cached blocks, not in use.
    assert kv.pool.blocks[4].ref_cnt == 0 and kv.pool.blocks[4].hash_key is not None
    assert kv.num_free_blocks == 31 - 6
    kv.free(a)
    assert_pool_clean(kv)


def test_sliding_hit_needs_only_the_window_blocks() -> None:
    kv = make_kv([W, None], 16)
    a = make_request("a", list(range(40)))
    assert step(kv, a, 40) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    a.output_token_ids.append(99)
    assert step(kv, a, 1) == [[1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12]]  # 6 7 8 released
    b = make_request("b", list(range(40)) + [900, 901, 902, 903, 904])
    assert kv.get_computed_blocks(b) == 40
    assert step(kv, b, 5, 40) == [[1, 2, 3, 4, 5, 13], [0, 0, 0, 9, 10, 14]]
    # A shorter prefix needs older sliding blocks: 24 cached tokens need blocks 1 and 2 (7, 8).
    c = make_request("c", list(range(24)) + [7, 7, 7, 7, 7])
    assert kv.peek_computed_tokens(c) == 24
    # Evict the released sliding blocks (LRU: 6 7 8 after never-used 15).
    d = make_request("d", list(range(600, 616)))
    assert step(kv, d, 16) == [[15, 6], [7, 8]]
    # The full group still has 1 2 3, but no k <= 3 has its sliding blocks: no hit at all.
    assert kv.peek_computed_tokens(c) == 0
    for r in (a, b, c, d):
        kv.free(r)
    assert_pool_clean(kv)


def test_only_sliding_groups_use_the_same_rule() -> None:
    kv = make_kv([W], 16)
    a = make_request("a", list(range(40)))
    step(kv, a, 40)
    a.output_token_ids.append(99)
    assert step(kv, a, 1) == [[0, 0, 0, 4, 5, 6]]
    b = make_request("b", list(range(41)))  # hashes up to block 4 (positions 0..39) are cached
    assert kv.get_computed_blocks(b) == 40
    assert step(kv, b, 1, 40) == [[0, 0, 0, 4, 5, 7]]
    kv.free(a)
    kv.free(b)
    assert_pool_clean(kv)


def test_gemma3_like_layout_one_table_per_group() -> None:
    layout = KVLayout.from_layer_windows(
        [512] * 5 + [None], block_size=16, num_kv_heads=1, head_dim=256, dtype_bytes=2
    )
    assert [g.sliding_window for g in layout.groups] == [None, 512, 512, 512, 512, 512]
    assert [g.layer_ids for g in layout.groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    kv = make_kv([W] * 5 + [None], 64)
    a = make_request("a", list(range(20)))
    tables = step(kv, a, 20)
    assert tables == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15], [16, 17, 18]]
    for pos in range(20, 24):
        a.output_token_ids.append(pos)
        tables = step(kv, a, 1)
    assert tables == [[1, 2, 3], [0, 5, 6], [0, 8, 9], [0, 11, 12], [0, 14, 15], [0, 17, 18]]
    b = make_request("b", list(range(20)) + [20, 21, 22, 23, 555])
    assert kv.get_computed_blocks(b) == 24  # 3 full blocks in every group
    assert step(kv, b, 1, 24)[1] == [0, 5, 6, 20]  # 24 sees 9..24: block 0 is not needed
    kv.free(a)
    kv.free(b)
    assert_pool_clean(kv)
