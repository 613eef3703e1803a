"""8-bit KV storage: quantize/dequantize round trips within the formats' rounding, page writes."""

from __future__ import annotations

import pytest
import torch

from tidal.attention.kv_quant import QuantizedKV, dequantize_kv, quantize_kv
from tidal.kv.layout import KVLayout
from tidal.worker.kv_cache import allocate_kv_caches


def _sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g)  # (T, KVH, D)
    x[0] *= 1e-3  # a row of small values: the per-row scale must keep their precision
    x[1, :, 5] = 80.0  # an outlier only widens its own row's scale
    return x


def test_int8_round_trip_error_is_at_most_half_a_step() -> None:
    x = _sample()
    q, scale = quantize_kv(x, "int8")
    assert q.dtype == torch.int8 and scale.shape == (64, 4) and scale.dtype == torch.float32
    back = dequantize_kv(q, scale, "int8", torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127  # (T, KVH, 1)
    err = (back - x).abs()
    assert bool((err <= step / 2 + 1e-7).all()), f"max error {(err / step).max():.3f} steps"
    assert q.abs().max() == 127  # the largest element of every row maps to +-127
    # Relative to each row's largest value, int8 is within 0.4% (1/254).
    assert float((err / x.abs().amax(-1, keepdim=True)).max()) <= 1 / 254 + 1e-6


def test_fp8_round_trip_error_is_within_e4m3_rounding() -> None:
    x = _sample()
    q, scale = quantize_kv(x, "fp8")
    assert q.dtype == torch.uint8  # raw e4m3 bytes
    back = dequantize_kv(q, scale, "fp8", torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; below 2^-6 * scale
    # (subnormals) the spacing is 2^-9 * scale, so the absolute error is <= 2^-10 * scale.
    bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10) + 1e-7
    err = (back - x).abs()
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max():.3f}"
    # The 1e-3 row kept its precision: cast without a scale it would fall among e4m3's
    # subnormals (spacing 2^-9 ~ 0.002) and lose most of it.
    unscaled = (x[0].to(torch.float8_e4m3fn).float() - x[0]).abs().max()
    assert float((back[0] - x[0]).abs().max()) < float(unscaled) / 4


def test_zero_rows_stay_zero_and_bad_dtype_is_refused() -> None:
    x = torch.zeros(3, 2, 8)
    for kv in ("int8", "fp8"):
        q, scale = quantize_kv(x, kv)
        assert torch.equal(dequantize_kv(q, scale, kv, torch.float32), x)
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is invalid"):
        quantize_kv(x, "int4")


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_pages_write_through_slots_and_gather_by_block(kv: str) -> None:
    layout = KVLayout.from_layer_windows(
        [None, None], block_size=4, num_kv_heads=2, head_dim=8, dtype_bytes=4, kv_dtype=kv
    )
    caches = allocate_kv_caches(layout, 5, torch.float32, "cpu")
    k0, v1 = caches[0][0], caches[1][1]
    assert isinstance(k0, QuantizedKV) and k0.shape == (5, 4, 2, 8)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([4, 5, 6, 7, 12, 13])  # block 1 full, block 3 offsets 0-1
    k0.write(slots, x)
    pages = k0.gather(torch.tensor([[1, 3]]), torch.float32)  # (1, 2, bs, KVH, D)
    assert pages.shape == (1, 2, 4, 2, 8)
    got = torch.cat([pages[0, 0], pages[0, 1, :2]])
    ref = dequantize_kv(*quantize_kv(x, kv), kv, torch.float32)
    assert torch.equal(got, ref)
    assert torch.equal(pages[0, 1, 2:], torch.zeros(2, 2, 8))  # unwritten slots read 0
    # Layers and K/V are separate views of one pool: the write touched no other page.
    assert not k0.data[0].any() and not v1.data.any()
    assert not caches[0][1].data.any() and not caches[1][0].data.any()
