"""Bytes per KV page for each memory.kv_cache_dtype, and the blocks a budget holds (exact)."""

from __future__ import annotations

import pytest

from tidal.config.cache import CacheConfig
from tidal.kv.block_pool import (
    num_blocks_for_budget,
    num_blocks_for_tokens,
    sliding_window_blocks,
)
from tidal.kv.layout import KVLayout

GIB = 1 << 30
# Gemma 3 270M: 18 layers, 3 full + 15 sliding (window 512) -> groups of 3; 1 KV head of 256.
GEMMA_WINDOWS = ([512] * 5 + [None]) * 3


def gemma_layout(dtype_bytes: int, kv_dtype: str = "auto") -> KVLayout:
    return KVLayout.from_layer_windows(
        GEMMA_WINDOWS,
        block_size=16,
        num_kv_heads=1,
        head_dim=256,
        dtype_bytes=dtype_bytes,
        kv_dtype=kv_dtype,
    )


def test_page_bytes_count_the_scales() -> None:
    # 2 (K, V) * 3 layers * 16 tokens * 1 head * bytes per head
    assert gemma_layout(4).page_bytes == 2 * 3 * 16 * 256 * 4 == 98304
    assert gemma_layout(2).page_bytes == 2 * 3 * 16 * 256 * 2 == 49152
    for kv in ("int8", "fp8"):
        # 256 one-byte elements + one float32 scale per (token, head); dtype_bytes is irrelevant.
        assert gemma_layout(4, kv).page_bytes == 2 * 3 * 16 * (256 + 4) == 24960
        assert gemma_layout(2, kv).page_bytes == 24960


def test_blocks_in_the_default_cpu_budget() -> None:
    budget = CacheConfig().max_cpu_kv_bytes
    assert budget == GIB
    fp32 = num_blocks_for_budget(gemma_layout(4), budget)
    bf16 = num_blocks_for_budget(gemma_layout(2), budget)
    int8 = num_blocks_for_budget(gemma_layout(2, "int8"), budget)
    assert (fp32, bf16, int8) == (10922, 21845, 43018)
    # 43018 * 16 = 688288 tokens of context in 1 GiB, vs 349520 in bfloat16.
    assert int8 / bf16 == pytest.approx(512 / 260, rel=1e-3)  # 1.97x
    assert int8 / fp32 == pytest.approx(1024 / 260, rel=1e-3)  # 3.94x


def test_small_head_dim_pays_relatively_more_for_scales() -> None:
    # head_dim 64 (Llama-style tiny heads): 68 vs 128 bytes per (token, head) -> 1.88x of float16.
    f16 = KVLayout.from_layer_windows(
        [None], block_size=16, num_kv_heads=8, head_dim=64, dtype_bytes=2
    )
    i8 = KVLayout.from_layer_windows(
        [None], block_size=16, num_kv_heads=8, head_dim=64, dtype_bytes=2, kv_dtype="int8"
    )
    assert (f16.page_bytes, i8.page_bytes) == (2 * 16 * 8 * 128, 2 * 16 * 8 * 68)
    assert num_blocks_for_budget(i8, 1 << 20) == (1 << 20) // 17408 == 60


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_16_bit_pages_are_half_of_float32(kv: str) -> None:
    # A float32 model with 16-bit pages: 2 bytes an element whatever the compute dtype.
    assert gemma_layout(4, kv).page_bytes == 2 * 3 * 16 * 256 * 2 == 49152
    assert not gemma_layout(4, kv).quantized
    assert num_blocks_for_budget(gemma_layout(4, kv), GIB) == 21845


def test_float32_pages_under_16_bit_compute() -> None:
    assert gemma_layout(2, "float32").page_bytes == gemma_layout(4).page_bytes == 98304


def test_auto_is_float16_over_a_gguf_own_blocks() -> None:
    from tidal.config.cache import resolve_kv_dtype

    assert resolve_kv_dtype("auto", "gguf") == resolve_kv_dtype("auto", "gguf-q8") == "float16"
    for scheme in ("none", "int8", "int4", "fp8"):
        assert resolve_kv_dtype("auto", scheme) == "auto"  # the model's dtype
    for kv in ("float32", "bfloat16", "int8"):
        assert resolve_kv_dtype(kv, "gguf") == kv


def test_unknown_kv_dtype_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match="kv_cache_dtype='int4' is invalid: expected one of auto, float32, float16, bfloat16, "
        "int8, fp8",
    ):
        gemma_layout(2, "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' is invalid: expected one of auto"):
        CacheConfig(kv_cache_dtype="fp16")


def test_blocks_for_a_token_count_cover_every_group() -> None:
    # Gemma 3 270M: 6 groups (1 full, 5 sliding, window 512). One sequence of 4096 tokens: 256
    # pages in the full group; a sliding group holds at most its window's 33 pages plus one
    # step's chunk of 1024 tokens (64 more), so 97, not 256.
    layout = gemma_layout(4)
    assert len(layout.groups) == 6
    assert sliding_window_blocks(512, 16, 1, 1024) == 33 + 64
    assert num_blocks_for_tokens(layout, 4096, 1, 1024) == 1 + 256 + 5 * 97
    assert num_blocks_for_tokens(layout, 4097, 1, 1024) == 1 + 257 + 5 * 97  # a partial page
    # A short pool: a sliding group never needs more pages than the full group.
    assert num_blocks_for_tokens(layout, 160, 1, 1024) == 1 + 6 * 10
    for bad, match in (
        ((0, 1, 1024), "tokens=0 is invalid"),
        ((16, 0, 1024), "max_num_seqs=0 is invalid"),
        ((16, 1, 0), "max_step_tokens=0 is invalid"),
    ):
        with pytest.raises(ValueError, match=match):
            num_blocks_for_tokens(layout, *bad)


def test_token_pool_for_llama_server_slots_sizes_sliding_groups_by_their_window() -> None:
    """llama-server -c 49152 -np 12 (12 slots of 4096) against --kv-cache-tokens 49152 with 12
    sequences: 12 partial last pages in the full group, and per sliding group 12 windows of 33
    pages plus what a 1024-token step adds (12 chunks of 3 tokens each start a page, the other
    988 tokens fill 61 more): 469 pages, not 3072. The pool is 29% of N tokens in every layer."""
    layout = gemma_layout(4)
    full = 12 + (49152 - 12) // 16
    assert full == 3083
    assert sliding_window_blocks(512, 16, 12, 1024) == 12 * 33 + 12 + (1024 - 12 * 3) // 16 == 469
    num_blocks = num_blocks_for_tokens(layout, 49152, 12, 1024)
    assert num_blocks == 1 + full + 5 * 469 == 5429
    every_layer = 1 + 6 * 49152 // 16
    assert (num_blocks - 1) / (every_layer - 1) == pytest.approx(0.2945, abs=1e-4)


def test_kv_cache_tokens_and_bytes_are_exclusive() -> None:
    assert CacheConfig(kv_cache_tokens=4096).kv_cache_tokens == 4096
    with pytest.raises(ValueError, match="kv_cache_tokens=4096 is invalid: expected null when"):
        CacheConfig(kv_cache_tokens=4096, kv_cache_bytes=GIB)
    with pytest.raises(ValueError, match="kv_cache_tokens=0 is invalid"):
        CacheConfig(kv_cache_tokens=0)
