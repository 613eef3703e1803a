"""The KV pool's device memory: one tensor shaped by KVLayout, viewed per layer."""

from __future__ import annotations

import torch

from tidal.attention.kv_quant import QuantizedKV, allocate_quantized_pool
from tidal.attention.page_memory import zeroed_pages
from tidal.kv.layout import FLOAT_KV_BYTES, KVLayout

# Per layer (k_cache, v_cache): float tensors, or QuantizedKV pages when layout.kv_dtype is 8-bit;
# a latent layout (layout.parts == 1, DeepSeek's MLA) gives each layer its one page tensor.
KVCache = (
    tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedKV, QuantizedKV] | torch.Tensor | QuantizedKV
)


def allocate_kv_caches(
    layout: KVLayout, num_blocks: int, dtype: torch.dtype, device: torch.device | str
) -> list[KVCache]:
    """Per layer, (k_cache, v_cache) of shape (num_blocks, block_size, KVH, D), or with
    layout.parts == 1 the one latent page tensor of that shape.

    The pool is (layers_per_group, parts, num_blocks, block_size, KVH, D): layer j of every group uses
    slot j, so a block id owned by group g only ever holds g's layers. Zero-filled, because the
    null block 0 is read (and masked out) by sliding layers, and 0 * NaN would poison the output;
    on the CPU the zeros are lazily backed (attention/page_memory.py): a page that no token
    reaches costs no resident memory.
    `dtype` is the float storage of layout.kv_dtype "auto"; the other layouts ignore it.
    """
    shape = (
        layout.layers_per_group,
        layout.parts,
        num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
    )
    if layout.quantized:
        data, scale = allocate_quantized_pool(
            *shape[:1], *shape[2:], layout.kv_dtype, device, parts=layout.parts
        )
    else:
        named = layout.kv_dtype in FLOAT_KV_BYTES  # "float32", "float16", "bfloat16"
        storage = getattr(torch, layout.kv_dtype) if named else dtype
        pool = zeroed_pages(shape, storage, device)
    caches: list[KVCache] = [None] * layout.num_layers  # type: ignore[list-item]
    for spec in layout.groups:
        for slot, layer_id in enumerate(spec.layer_ids):
            if layout.parts == 1:
                caches[layer_id] = (
                    QuantizedKV(data[slot, 0], scale[slot, 0], layout.kv_dtype)
                    if layout.quantized
                    else pool[slot, 0]
                )
            elif layout.quantized:
                caches[layer_id] = (
                    QuantizedKV(data[slot, 0], scale[slot, 0], layout.kv_dtype),
                    QuantizedKV(data[slot, 1], scale[slot, 1], layout.kv_dtype),
                )
            else:
                caches[layer_id] = (pool[slot, 0], pool[slot, 1])
    return caches
