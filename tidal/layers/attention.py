"""Self-attention block: q/k/v projections, optional q/k norm, rotary, paged attention, output."""

from __future__ import annotations

import torch
from torch import nn

from tidal.attention.cpu_paged import CpuPagedAttention
from tidal.attention.metadata import AttentionMetadata
from tidal.config.arch import ArchConfig
from tidal.kernels.norm_rope import qk_norm_rope_
from tidal.layers.linear import fuse_linears
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import apply_rotary

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
        # Set by fuse_projections() once the weights are loaded (q/k/v keep HF names until then).
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = (q_dim, kv_dim, kv_dim)
        gemma = arch.family == "gemma3"
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma) if arch.qk_norm else None
        self.layer_type = arch.layer_types[layer_id]
        self.backend = CpuPagedAttention()  # the C kernel on CPU, the torch reference else

    def fuse_projections(self) -> None:
        """One q/k/v matmul per step instead of three, where the weight format allows it."""
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            del self.q_proj, self.k_proj, self.v_proj
            self.qkv_proj = fused

    def _norm_rope_in_place(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> bool:
        """q/k norm and rotary as one C call on CPU float32 (q and k are this step's fresh
        projections, so writing them in place is safe); False: the caller runs torch."""
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return False
        scale_q = scale_k = None
        eps = 0.0
        if self.q_norm is not None and self.k_norm is not None:
            scale_q, scale_k = self.q_norm.float_scale(), self.k_norm.float_scale()
            if scale_q is None or scale_k is None:
                return False
            eps = self.q_norm.eps
        return qk_norm_rope_(q, k, scale_q, scale_k, eps, cos, sin)

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # column views
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        if not self._norm_rope_in_place(q, k, cos, sin):
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
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
