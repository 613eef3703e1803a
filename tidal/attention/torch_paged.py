"""The reference paged-attention backend in pure PyTorch: exact causal and sliding-window masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.attention.kv_quant import QuantizedKV
from tidal.attention.metadata import AttentionMetadata

_F16_MAX = torch.finfo(torch.float16).max

# A layer's K or V pages: a float tensor, or 8-bit pages with scales (memory.kv_cache_dtype).
KVPages = torch.Tensor | QuantizedKV


class TorchPagedAttention:
    """Writes the step's K/V into the pool through the slot mapping, then attends each query to
    the keys it may see: positions <= its own and, for a sliding layer of window W, > pos - W.

    With 8-bit pages the step's K/V are quantized on the write and every read (the step's own
    tokens included) dequantizes the gathered pages, so a prefix-cache hit sees the same values
    as the step that computed them."""

    def forward(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, KVH, D)
        v: torch.Tensor,  # (T, KVH, D)
        k_cache: KVPages,  # (num_blocks, block_size, KVH, D)
        v_cache: KVPages,
        meta: AttentionMetadata,
        group: int,
        window: int | None,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        tables = meta.groups[group]
        bs = meta.block_size
        kvh, dim = k_cache.shape[2], k_cache.shape[3]
        _write(k_cache, tables.slot_mapping, k)
        _write(v_cache, tables.slot_mapping, v)
        if meta.all_decode and softcap is None:
            return self._decode(q, k_cache, v_cache, meta, tables.block_tables, window, scale)
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            n_q, ctx = meta.query_lens[i], meta.context_lens[i]
            first_q = ctx - n_q
            lo = 0 if window is None else max(0, first_q - window + 1)
            b0, b1 = lo // bs, (ctx - 1) // bs + 1
            blocks = tables.block_tables[i, b0:b1]
            keys = _pages(k_cache, blocks, q.dtype).reshape(-1, kvh, dim)[
                lo - b0 * bs : ctx - b0 * bs
            ]  # (S, KVH, D)
            vals = _pages(v_cache, blocks, q.dtype).reshape(-1, kvh, dim)[
                lo - b0 * bs : ctx - b0 * bs
            ]
            q_pos = torch.arange(first_q, ctx, device=q.device)[:, None]  # (n_q, 1)
            k_pos = torch.arange(lo, ctx, device=q.device)[None, :]  # (1, S)
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            s = meta.query_start[i]
            out[s : s + n_q] = _attend(q[s : s + n_q], keys, vals, allowed, scale, softcap)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: KVPages,
        v_cache: KVPages,
        meta: AttentionMetadata,
        block_tables: torch.Tensor,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence: gather every sequence's keys into a padded batch, one SDPA call."""
        bs = meta.block_size
        num_seqs, heads, dim = q.shape
        kvh = k_cache.shape[2]
        ctx = torch.tensor(meta.context_lens, device=q.device)  # (B,)
        lo = torch.zeros_like(ctx) if window is None else (ctx - window).clamp(min=0)
        b0 = int((lo // bs).min())
        b1 = int((ctx.max() - 1) // bs + 1)
        blocks = block_tables[:, b0:b1]  # (B, nb)
        keys = _pages(k_cache, blocks, q.dtype).reshape(num_seqs, -1, kvh, dim)  # (B, S, KVH, D)
        vals = _pages(v_cache, blocks, q.dtype).reshape(num_seqs, -1, kvh, dim)
        k_pos = torch.arange(b0 * bs, b1 * bs, device=q.device)[None, :]  # (1, S)
        allowed = (k_pos < ctx[:, None]) & (k_pos >= lo[:, None])  # (B, S)
        mask = allowed[:, None, None, :]  # (B, 1, 1, S)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],  # (B, H, 1, D)
            keys.transpose(1, 2).to(q.dtype),  # (B, KVH, S, D)
            vals.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=heads != kvh,
        )
        return o[:, :, 0, :]  # (B, H, D)


def _write(cache: KVPages, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Store x (T, KVH, D) at the flat slots (block_id * block_size + offset)."""
    if isinstance(cache, QuantizedKV):
        cache.write(slot_mapping, x)
        return
    kvh, dim = cache.shape[2], cache.shape[3]
    if cache.dtype == torch.float16 and x.dtype != torch.float16:
        # float16 pages under wider compute saturate at +-65504 (as the CPU kernel writes them)
        # rather than turning a large key or value into an infinity
        x = x.clamp(-_F16_MAX, _F16_MAX)
    cache.view(-1, kvh, dim).index_copy_(0, slot_mapping, x.to(cache.dtype))


def _pages(cache: KVPages, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pages `blocks` as floats: blocks.shape + (block_size, KVH, D)."""
    if isinstance(cache, QuantizedKV):
        return cache.gather(blocks, dtype)
    return cache[blocks].to(dtype)  # bfloat16 pages under float32 compute widen here; else a no-op


def _attend(
    q: torch.Tensor,  # (n_q, H, D)
    keys: torch.Tensor,  # (S, KVH, D)
    vals: torch.Tensor,
    allowed: torch.Tensor,  # (n_q, S) bool
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    heads, kvh = q.shape[1], keys.shape[1]
    qh = q.transpose(0, 1)  # (H, n_q, D)
    kh = keys.transpose(0, 1).to(q.dtype)  # (KVH, S, D)
    vh = vals.transpose(0, 1).to(q.dtype)
    if softcap is None:
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=allowed[None], scale=scale, enable_gqa=heads != kvh
        )
        return o.transpose(0, 1)  # (n_q, H, D)
    rep = heads // kvh
    kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)  # (H, S, D)
    scores = (qh @ kh.transpose(1, 2)) * scale  # (H, n_q, S)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs @ vh).transpose(0, 1)
