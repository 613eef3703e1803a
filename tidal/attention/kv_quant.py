"""QuantizedKV: an 8-bit KV cache pool (int8 or fp8 e4m3) with one float32 scale per token and head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.attention.page_memory import zeroed_pages

# Largest magnitude each format holds: int8 is symmetric in [-127, 127] (-128 unused so that
# negation is exact); float8 e4m3fn's largest finite value is 448.
_QMAX = {"int8": 127.0, "fp8": 448.0}
# Both formats sit in a uint8/int8 tensor: CPU torch lacks index_copy_ for float8, so fp8 is
# stored as its raw bytes and viewed as float8_e4m3fn only to convert.
_STORAGE = {"int8": torch.int8, "fp8": torch.uint8}
# A zero vector (the null block, padding) gets this scale instead of 0, so 0 / scale stays 0.
_MIN_SCALE = 1e-12


@dataclass(slots=True)
class QuantizedKV:
    """One layer's K (or V) pages: `data` (num_blocks, block_size, KVH, D) in 8 bits and `scale`
    (num_blocks, block_size, KVH) float32. The attention backend writes with `write` and reads
    gathered pages with `gather`; the value of element d of (token, head) is data * scale."""

    data: torch.Tensor
    scale: torch.Tensor
    kv_dtype: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x (T, KVH, D) and store token t in flat slot slot_mapping[t]."""
        q, scale = quantize_kv(x, self.kv_dtype)
        kvh, dim = self.data.shape[2], self.data.shape[3]
        self.data.view(-1, kvh, dim).index_copy_(0, slot_mapping, q)
        self.scale.view(-1, kvh).index_copy_(0, slot_mapping, scale)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pages `blocks` (any index shape) dequantized to dtype: blocks.shape + (bs, KVH, D)."""
        return dequantize_kv(self.data[blocks], self.scale[blocks], self.kv_dtype, dtype)


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (8-bit storage (..., D), float32 scale (...,)) with scale = amax / qmax."""
    if kv_dtype not in _QMAX:
        raise ValueError(f"kv_cache_dtype={kv_dtype!r} is invalid: expected int8 or fp8")
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / _QMAX[kv_dtype]).clamp(min=_MIN_SCALE)  # (...,)
    scaled = xf / scale[..., None]
    if kv_dtype == "int8":
        return scaled.round().clamp(-127, 127).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_kv(
    data: torch.Tensor, scale: torch.Tensor, kv_dtype: str, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of quantize_kv, in `dtype`."""
    values = data.view(torch.float8_e4m3fn) if kv_dtype == "fp8" else data
    return (values.float() * scale[..., None]).to(dtype)


def allocate_quantized_pool(
    layers_per_group: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    device: torch.device | str,
    parts: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (data, scale) pools shaped (layers_per_group, parts, num_blocks, block_size, KVH[, D]).

    NOTE: the scales are zero too, so that neither tensor is written at start-up (both are
    lazily backed on the CPU, see attention/page_memory.py). A never-written slot (the null
    block, the tail of a partial page) then dequantizes to code 0 * scale 0 = 0.0, as it did
    with scale 1; nothing divides by a stored scale (quantize_kv divides by the new one)."""
    if kv_dtype not in _STORAGE:
        raise ValueError(f"kv_cache_dtype={kv_dtype!r} is invalid: expected int8 or fp8")
    shape = (layers_per_group, parts, num_blocks, block_size, num_kv_heads)
    data = zeroed_pages((*shape, head_dim), _STORAGE[kv_dtype], device)
    scale = zeroed_pages(shape, torch.float32, device)
    return data, scale
