"""DeepSeek V2/V3 (and R1): multi-head latent attention over a latent KV cache, routed + shared experts."""

from __future__ import annotations

import torch
from torch import nn

from tidal.attention.metadata import AttentionMetadata
from tidal.attention.torch_paged import KVPages
from tidal.config.arch import FULL, ArchConfig
from tidal.layers.attention import CosSin
from tidal.layers.linear import linear_into
from tidal.layers.mla_attention import MLAttention
from tidal.layers.mlp import GatedMLP
from tidal.layers.moe import SparseMoE
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_id: int, kv_group: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = MLAttention(arch, layer_id, kv_group)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: nn.Module
        if layer_id in arch.moe_layers:
            assert arch.moe is not None
            self.mlp = SparseMoE(arch.hidden_size, arch.moe, arch.hidden_act)
        else:  # the first_k_dense_replace layers (and those moe_layer_freq skips)
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata, kv_cache: KVPages
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, arch: ArchConfig, kv_groups: list[int]) -> None:
        super().__init__()
        assert arch.mla is not None
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(arch, i, kv_groups[i]) for i in range(arch.num_layers)
        )
        # Only the shared rope part of each head rotates: one table of qk_rope_head_dim.
        self.rotary = RotaryEmbedding(arch.mla.qk_rope_head_dim, arch.rope[FULL])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class DeepseekV2ForCausalLM(nn.Module):
    """HF parameter names (DeepseekV2ForCausalLM and DeepseekV3ForCausalLM), so safetensors load
    as is. `kv_caches[i]` is layer i's latent page tensor (the KV layout's parts == 1); the C
    decoder stack (layers/native_decoder.py) does not cover this shape, every step runs the
    modules."""

    def __init__(self, arch: ArchConfig, kv_groups: list[int]) -> None:
        super().__init__()
        if arch.mla is None:
            raise ValueError(f"family {arch.family!r} has no MLA settings (kv_lora_rank, ...)")
        self.arch = arch
        self.model = DeepseekModel(arch, kv_groups)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[KVPages],
    ) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, meta, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32, into `out` where the head's format can write there."""
        return linear_into(self.lm_head, hidden, out).float()
