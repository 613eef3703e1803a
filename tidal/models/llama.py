"""The Llama family: Llama 2/3/3.1, Mistral (sliding window), Qwen2/2.5 (qkv bias), Qwen3 (q/k norm),
and its mixture-of-experts variants Mixtral and Qwen3-MoE."""

from __future__ import annotations

import torch
from torch import nn

from tidal.attention.metadata import AttentionMetadata
from tidal.config.arch import ArchConfig
from tidal.layers.attention import CosSin, KVCache, SelfAttention
from tidal.layers.linear import linear_into
from tidal.layers.mlp import GatedMLP
from tidal.layers.moe import SparseMoE
from tidal.layers.native_decoder import NativeDecoder
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding, rotary_tables


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_id: int, kv_group: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = SelfAttention(arch, layer_id, kv_group)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: nn.Module
        if layer_id in arch.moe_layers:  # Mixtral's block_sparse_moe is renamed mlp on load
            assert arch.moe is not None
            self.mlp = SparseMoE(arch.hidden_size, arch.moe, arch.hidden_act)
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, kv_groups: list[int]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, kv_groups[i]) for i in range(arch.num_layers)
        )
        # One rotary table per layer type (Gemma 3: local and global bases), shared by its layers.
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(arch.head_dim, arch.rope[t]) for t in sorted(set(arch.layer_types))}
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.native = NativeDecoder(self.layers, sorted(self.rotary), self.norm)
        if arch.moe_layers:  # the C decoder stack runs dense MLPs only
            self.native.enabled = False


class LlamaForCausalLM(nn.Module):
    """HF parameter names (model.layers.N.self_attn.q_proj.weight, ...), so safetensors load as is.

    `kv_groups[i]` is the KV group of layer i (tidal.kv.layout.KVLayout.layer_slot)."""

    def __init__(self, arch: ArchConfig, kv_groups: list[int]) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, kv_groups)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = rotary_tables(self.model.rotary, positions, x.dtype)
        return self.model.native.forward(x, cos_sin, meta, kv_caches)  # layers, final norm

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32, into `out` where the head's format can write there."""
        return linear_into(self.lm_head, hidden, out).float()
