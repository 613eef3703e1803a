"""Paged multi-head latent attention (DeepSeek V2/V3) over a cache of latents: decode rows in the
C paged-attention kernel, prefill chunks in PyTorch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tidal.attention.cpu_paged import page_args
from tidal.attention.metadata import AttentionMetadata
from tidal.attention.torch_paged import KVPages, _pages, _write
from tidal.kernels import paged_attention as paged_kernel
from tidal.kernels.gguf_gemm import BlockSegments, gguf_gemm_jobs


class MLAPagedAttention:
    """Each cached token is one vector [c (kv_lora_rank) | k_pe (rope dim)]: the normed KV latent
    and the rotated shared key. With W_UK (H, nope, rank) and W_UV (H, v, rank) the halves of
    kv_b_proj, head h's key is [W_UK[h] c | k_pe] and its value W_UV[h] c.

    - A sequence with one new token (decode) attends over the latents directly: the query is
      absorbed, q' = [q_nope W_UK[h] | q_pe] (H, rank + rope), the output o' (H, rank) comes
      back through W_UV; the cache is never expanded.
    - A sequence with several new tokens (prefill chunks) expands its context's latents to
      per-head keys and values (the cheaper form when many queries share them).

    Which form a sequence takes depends on its own query count only, never on the batch.
    """

    def forward(
        self,
        q_nope: torch.Tensor,  # (T, H, nope)
        q_pe: torch.Tensor,  # (T, H, rope), rotated
        latent: torch.Tensor,  # (T, rank + rope): [c | k_pe rotated]
        cache: KVPages,  # (num_blocks, block_size, 1, rank + rope)
        meta: AttentionMetadata,
        group: int,
        w_uk: torch.Tensor,  # (H, nope, rank)
        w_uv: torch.Tensor,  # (H, v, rank)
        scale: float,
        latent_jobs: tuple[Sequence[BlockSegments], Sequence[BlockSegments]] | None = None,
    ) -> torch.Tensor:
        """(T, H, v) attention outputs, before o_proj. `latent_jobs`: W_UK[h]^T and W_UV[h] per
        head in GGUF blocks, which the decode rows multiply by with int8 activations (one
        kernel call each for all heads and sequences) instead of by the float W_UK and W_UV."""
        tables = meta.groups[group]
        _write(cache, tables.slot_mapping, latent[:, None, :])
        num_tokens, heads, _ = q_nope.shape
        out = q_nope.new_empty(num_tokens, heads, w_uv.shape[1])
        decode = [i for i in range(meta.num_seqs) if meta.query_lens[i] == 1]
        if decode:
            rows = [meta.query_start[i] for i in decode]
            out[rows] = self._decode(
                q_nope[rows], q_pe[rows], cache, meta, tables.block_tables[decode], decode,
                w_uk, w_uv, scale, latent_jobs, latent[rows], tables.slot_mapping[rows],
            )  # fmt: skip
        for i in range(meta.num_seqs):
            if meta.query_lens[i] == 1:
                continue
            s, n_q = meta.query_start[i], meta.query_lens[i]
            out[s : s + n_q] = self._prefill(
                q_nope[s : s + n_q], q_pe[s : s + n_q], cache, meta, tables.block_tables[i], i,
                w_uk, w_uv, scale,
            )  # fmt: skip
        return out

    def _decode(
        self,
        q_nope: torch.Tensor,  # (B, H, nope)
        q_pe: torch.Tensor,  # (B, H, rope)
        cache: KVPages,
        meta: AttentionMetadata,
        block_tables: torch.Tensor,  # (B, max_blocks)
        seqs: list[int],
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
        latent_jobs: tuple[Sequence[BlockSegments], Sequence[BlockSegments]] | None,
        latent: torch.Tensor,  # (B, rank + rope): the new tokens' latents (already written)
        slots: torch.Tensor,  # (B,) their slots
    ) -> torch.Tensor:
        rank = w_uk.shape[2]
        q_lat = None
        if latent_jobs is not None:
            q_lat = _per_head(q_nope, latent_jobs[0])  # (B, H, rank)
        if q_lat is None:
            latent_jobs = None
            q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # (B, H, rank)
        q = torch.cat((q_lat, q_pe), dim=-1)  # (B, H, rank + rope)
        o_lat = _kernel_decode(q, latent, cache, meta, block_tables, seqs, slots, scale)
        if o_lat is None:
            o_lat = self._torch_decode(q, cache, meta, block_tables, seqs, rank, scale)
        else:
            o_lat = o_lat[..., :rank]
        if latent_jobs is not None:
            out = _per_head(o_lat, latent_jobs[1])
            if out is not None:
                return out
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)  # (B, H, v)

    @staticmethod
    def _torch_decode(
        q: torch.Tensor,  # (B, H, rank + rope) absorbed queries
        cache: KVPages,
        meta: AttentionMetadata,
        block_tables: torch.Tensor,
        seqs: list[int],
        rank: int,
        scale: float,
    ) -> torch.Tensor:
        """(B, H, rank) latent outputs, the cache's pages gathered and widened in torch."""
        bs = meta.block_size
        ctx = torch.tensor([meta.context_lens[i] for i in seqs], device=q.device)  # (B,)
        num_blocks = int((ctx.max() - 1) // bs + 1)
        pages = _pages(cache, block_tables[:, :num_blocks], q.dtype)
        lat = pages.reshape(len(seqs), num_blocks * bs, -1)  # (B, S, rank + rope)
        scores = (q @ lat.transpose(1, 2)).float() * scale  # (B, H, S)
        k_pos = torch.arange(num_blocks * bs, device=q.device)[None, :]  # (1, S)
        scores = scores.masked_fill(~(k_pos < ctx[:, None])[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return probs @ lat[..., :rank]  # (B, H, rank)

    def _prefill(
        self,
        q_nope: torch.Tensor,  # (n_q, H, nope)
        q_pe: torch.Tensor,  # (n_q, H, rope)
        cache: KVPages,
        meta: AttentionMetadata,
        block_table: torch.Tensor,  # (max_blocks,)
        seq: int,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        bs = meta.block_size
        rank = w_uk.shape[2]
        n_q, ctx = meta.query_lens[seq], meta.context_lens[seq]
        num_blocks = (ctx - 1) // bs + 1
        lat = _pages(cache, block_table[:num_blocks], q_nope.dtype).reshape(-1, lat_dim(cache))
        lat = lat[:ctx]  # (S, rank + rope): cached prefix, earlier chunks and this chunk
        c, k_pe = lat[:, :rank], lat[:, rank:]
        heads = q_nope.shape[1]
        k_nope = torch.einsum("sr,hnr->hsn", c, w_uk)  # (H, S, nope)
        values = torch.einsum("sr,hvr->hsv", c, w_uv)  # (H, S, v)
        keys = torch.cat((k_nope, k_pe[None].expand(heads, -1, -1)), dim=-1)  # (H, S, nope+rope)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # (H, n_q, nope + rope)
        q_pos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None]  # (n_q, 1)
        k_pos = torch.arange(ctx, device=q.device)[None, :]  # (1, S)
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=(k_pos <= q_pos)[None], scale=scale
        )  # (H, n_q, v)
        return o.transpose(0, 1)


def _kernel_decode(
    q: torch.Tensor,  # (B, H, rank + rope) float32 absorbed queries
    latent: torch.Tensor,  # (B, rank + rope)
    cache: KVPages,
    meta: AttentionMetadata,
    block_tables: torch.Tensor,  # (B, W)
    seqs: list[int],
    slots: torch.Tensor,  # (B,)
    scale: float,
) -> torch.Tensor | None:
    """The decode rows' attention over their latent pages read in place by the C paged-attention
    kernel, as multi-query attention: one KV head whose keys are the latents (rank + rope) and
    whose values are the same rows (the first `rank` of the (B, H, rank + rope) result are the
    latent outputs; the kernel rewrites each new latent where _write put it, the same bytes).
    Every decode row goes this way whatever else the step holds, so its result does not depend
    on the batch. None where the kernel cannot take the step (the caller runs torch)."""
    if q.dtype is not torch.float32 or not q.is_cpu or not paged_kernel.available():
        return None
    kv_type, pages, scales = page_args(cache)
    if kv_type is None or not pages.is_contiguous():
        return None
    b = q.shape[0]
    ctx = [meta.context_lens[i] for i in seqs]
    seq_arrays = torch.tensor([list(range(b)), [1] * b, ctx], dtype=torch.int32)
    kv = latent.float().contiguous()[:, None, :]  # (B, 1, rank + rope)
    args = (q.contiguous(), kv, kv, pages, pages, scales, scales, kv_type, slots.contiguous(),
            block_tables.contiguous(), seq_arrays, None, scale, None)  # fmt: skip
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("tidal::paged_attention"):
            return paged_kernel.paged_attention(*args)
    return paged_kernel.paged_attention(*args)


def _per_head(x: torch.Tensor, heads: Sequence[BlockSegments]) -> torch.Tensor | None:
    """(B, H, K) float32 -> (B, H, N): row b of head h times head h's (N, K) block weight, every
    head in one kernel call with int8 activations; None where the kernel cannot run."""
    b, h, k = x.shape
    if x.dtype is not torch.float32:
        return None
    rows = x.transpose(0, 1).reshape(h * b, k)  # head-major: job h takes rows h*b .. h*b + b-1
    y = gguf_gemm_jobs(rows, heads, [b] * h, torch.arange(h * b))
    return None if y is None else y.view(h, b, -1).transpose(0, 1)


def lat_dim(cache: KVPages) -> int:
    return int(cache.shape[-1])
