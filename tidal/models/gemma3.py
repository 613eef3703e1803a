"""Gemma 3 (text): interleaved sliding/global layers, four norms per block, GeGLU, scaled embeddings."""

from __future__ import annotations

import torch
from torch import nn

from tidal.attention.metadata import AttentionMetadata
from tidal.config.arch import ArchConfig
from tidal.layers.attention import CosSin, KVCache, SelfAttention
from tidal.layers.linear import linear_into
from tidal.layers.mlp import GatedMLP
from tidal.layers.native_decoder import NativeDecoder
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding, rotary_tables


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_id: int, kv_group: int) -> None:
        super().__init__()
        dim, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, gemma=True)
        self.self_attn = SelfAttention(arch, layer_id, kv_group)
        self.post_attention_layernorm = RMSNorm(dim, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, gemma=True)
        self.mlp = GatedMLP(dim, arch.intermediate_size, arch.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, gemma=True)

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, arch: ArchConfig, kv_groups: list[int]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, i, kv_groups[i]) for i in range(arch.num_layers)
        )
        # One rotary table per layer type (Gemma 3: local and global bases), shared by its layers.
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(arch.head_dim, arch.rope[t]) for t in sorted(set(arch.layer_types))}
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma=True)
        self.native = NativeDecoder(self.layers, sorted(self.rotary), self.norm)


class Gemma3ForCausalLM(nn.Module):
    """HF parameter names; the LM head is tied to the embedding."""

    def __init__(self, arch: ArchConfig, kv_groups: list[int]) -> None:
        super().__init__()
        self.arch = arch
        self.model = Gemma3Model(arch, kv_groups)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale = arch.hidden_size**0.5
        self._embed_scale: torch.Tensor | None = None  # as a tensor of the activations' dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # transformers rounds the scale to the weight dtype before multiplying; so do we.
        scale = self._embed_scale
        if scale is None or scale.dtype != x.dtype:
            scale = self._embed_scale = torch.tensor(self.embed_scale, dtype=x.dtype)
        x = x * scale
        cos_sin = rotary_tables(self.model.rotary, positions, x.dtype)
        return self.model.native.forward(x, cos_sin, meta, kv_caches)  # layers, final norm

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32, into `out` where the head's format can write there."""
        logits = linear_into(self.lm_head, hidden, out).float()
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
