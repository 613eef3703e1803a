"""The KV pool's memory: zero-filled like torch.zeros, but resident only where pages are written."""

from __future__ import annotations

import psutil
import pytest
import torch

from tidal.attention.kv_quant import QuantizedKV, dequantize_kv, quantize_kv
from tidal.attention.page_memory import zeroed_pages
from tidal.kv.layout import KVLayout
from tidal.worker.kv_cache import allocate_kv_caches

MIB = 1 << 20
# Gemma 3 270M's layout: 6 groups of 3 layers, 1 KV head of 256; a page is 96 KiB in float32.
WINDOWS = ([512] * 5 + [None]) * 3


def layout(kv_dtype: str = "auto") -> KVLayout:
    return KVLayout.from_layer_windows(
        WINDOWS, block_size=16, num_kv_heads=1, head_dim=256, dtype_bytes=4, kv_dtype=kv_dtype
    )


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "int8"])
def test_pool_costs_resident_memory_only_for_written_blocks(kv_dtype: str) -> None:
    """A 5,000-block pool (~470 MiB in float32) adds far less than its size to RSS until
    blocks are written; writing 100 blocks adds about their pages."""
    lay = layout(kv_dtype)
    num_blocks = 5000
    pool_bytes = num_blocks * lay.page_bytes
    before = rss()
    caches = allocate_kv_caches(lay, num_blocks, torch.float32, "cpu")
    allocated = rss() - before
    assert allocated < pool_bytes // 8, (allocated / MIB, pool_bytes / MIB)
    x = torch.randn(100 * 16, 1, 256)
    slots = torch.arange(16, 101 * 16)  # blocks 1..100
    for k, v in caches:
        if isinstance(k, QuantizedKV):
            k.write(slots, x)
            v.write(slots, x)
        else:
            k.view(-1, 1, 256).index_copy_(0, slots, x.to(k.dtype))
            v.view(-1, 1, 256).index_copy_(0, slots, x.to(v.dtype))
    written = rss() - before
    assert written >= 100 * lay.page_bytes * 0.9, (written / MIB, 100 * lay.page_bytes / MIB)
    assert written < pool_bytes // 4, (written / MIB, pool_bytes / MIB)
    # Never-written blocks (the null block 0, block 101 on) read as zeros, as torch.zeros did.
    k, v = caches[0]
    if isinstance(k, QuantizedKV):
        assert not k.gather(torch.tensor([0, 101, num_blocks - 1]), torch.float32).any()
        q, scale = quantize_kv(x[:16], "int8")
        assert torch.equal(
            k.gather(torch.tensor([1]), torch.float32)[0],
            dequantize_kv(q, scale, "int8", torch.float32),
        )
    else:
        assert not k[[0, 101, num_blocks - 1]].any() and not v[[0, 101]].any()
        assert torch.equal(k[1], x[:16].to(k.dtype))


def test_zeroed_pages_is_private_and_released_with_the_tensor() -> None:
    """The mapping is this tensor's own: writes through views land in it, two pools never
    alias, and dropping the tensor gives the memory back."""
    a = zeroed_pages((64, 1024), torch.float32, "cpu")
    b = zeroed_pages((64, 1024), torch.float32, "cpu")
    assert a.dtype is torch.float32 and a.shape == (64, 1024) and not a.any()
    a[3].fill_(2.0)
    assert a.sum() == 2.0 * 1024 and not b.any()
    big = zeroed_pages((256, MIB // 4), torch.float32, "cpu")  # 256 MiB
    big.fill_(1.0)
    touched = rss()
    del big
    assert touched - rss() >= 200 * MIB
    assert zeroed_pages((0, 4), torch.bfloat16, "cpu").shape == (0, 4)
