"""Self-attention block: q/k/v projections, optional q/k norm, rotary, paged attention, output."""

from __future__ import annotations

import torch
from torch import nn

from tidal.attention.cpu_paged import CpuPagedAttention
from tidal.attention.metadata import AttentionMetadata
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import apply_rotary
from tidal.models.arch import ArchConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each (blocks, block_size, KVH, D)
CosSin = tuple[torch.Tensor, torch.Tensor]  # (T, D) each, computed once per step per layer type


class SelfAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_id: int, kv_group: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.window = arch.window(layer_id)
        self.kv_group = kv_group
        self.scale = arch.attn_scale
        self.softcap = arch.attn_logit_softcapping
        hidden, q_dim, kv_dim = (
            arch.hidden_size,
            arch.num_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=False)
        gemma = arch.family == "gemma3"
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma) if arch.qk_norm else None
        self.layer_type = arch.layer_types[layer_id]
        self.backend = CpuPagedAttention()  # the C kernel on CPU, the torch reference else

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.backend.forward(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.kv_group,
            self.window,
            self.scale,
            self.softcap,
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
