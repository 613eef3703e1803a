"""KVLayout: how a model's layers share one pool of fixed-size KV pages (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from tidal.config.cache import KV_CACHE_DTYPES, QUANTIZED_KV_DTYPES

# Bytes per element of the named float page types, named as torch's dtypes ("auto": the model's)
FLOAT_KV_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

KV_SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """Layers that share one block table. `sliding_window` None means full attention."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One shared pool of pages; every page holds K and V of `layers_per_group` layers.

    Layers are split into groups of equal size, each group all-full or all-sliding, so that a
    page has the same size whichever group owns it (vLLM's hybrid allocator does the same).
    Gemma 3 270M: 3 full + 15 sliding layers -> gcd 3 -> 1 full group and 5 sliding groups of 3.
    A block id belongs to at most one group at a time; group g's layer j stores its K/V in slot j
    of the pages in group g's block table. Block 0 is the null block: never allocated, it fills
    table entries of sliding groups whose tokens fell out of the window.
    """

    groups: tuple[KVGroupSpec, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # bytes per element of the model's float dtype ("auto" storage)
    kv_dtype: str = "auto"
    parts: int = 2  # 2: K and V pages; 1: one latent page (MLA)

    @property
    def quantized(self) -> bool:
        """8-bit pages (codes and scales) rather than a float tensor."""
        return self.kv_dtype in QUANTIZED_KV_DTYPES

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layer_ids)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block id across the pool (K and V for layers_per_group layers).

        8-bit storage: head_dim bytes plus one float32 scale per (token, KV head), so a page of
        head_dim 256 is 260/512 of float16's (1.97x the blocks) and 260/1024 of float32's."""
        if self.quantized:
            per_head = self.head_dim + KV_SCALE_BYTES
        elif self.kv_dtype in FLOAT_KV_BYTES:
            per_head = self.head_dim * FLOAT_KV_BYTES[self.kv_dtype]
        else:
            per_head = self.head_dim * self.dtype_bytes
        return self.parts * self.layers_per_group * self.block_size * self.num_kv_heads * per_head

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token costs across all layers (a full-attention model's figure)."""
        return self.page_bytes * len(self.groups) // self.block_size

    def layer_slot(self, layer_id: int) -> tuple[int, int]:
        """(group index, slot within the page) of a layer."""
        for g, spec in enumerate(self.groups):
            if layer_id in spec.layer_ids:
                return g, spec.layer_ids.index(layer_id)
        raise KeyError(f"layer {layer_id} is in no KV group")

    @staticmethod
    def from_layer_windows(
        windows: list[int | None],
        *,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype_bytes: int,
        kv_dtype: str = "auto",
        parts: int = 2,
    ) -> KVLayout:
        """Group layers by window; each group holds gcd(class sizes) layers, in layer order."""
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} is invalid: expected a positive integer")
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={kv_dtype!r} is invalid: expected one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if parts not in (1, 2):
            raise ValueError(f"parts={parts} is invalid: expected 1 (a latent page) or 2 (K and V)")
        classes: dict[int | None, list[int]] = {}
        for layer_id, window in enumerate(windows):
            classes.setdefault(window, []).append(layer_id)
        size = 0
        for layer_ids in classes.values():
            size = gcd(size, len(layer_ids))
        groups: list[KVGroupSpec] = []
        for window, layer_ids in classes.items():
            for i in range(0, len(layer_ids), size):
                groups.append(KVGroupSpec(tuple(layer_ids[i : i + size]), window))
        # Full-attention groups first: they decide prefix-cache hits, see kv/manager.py.
        groups.sort(key=lambda g: (g.sliding_window is not None, g.layer_ids[0]))
        return KVLayout(
            tuple(groups), block_size, num_kv_heads, head_dim, dtype_bytes, kv_dtype, parts
        )
