"""The sparse-expert (MoE) and latent-attention (MLA) parts of ArchConfig, and their readers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Families whose attention is DeepSeek's multi-head latent attention (ArchConfig.mla is set).
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Routed experts of the sparse layers (Mixtral, Qwen3-MoE, DeepSeek V2/V3).

    Router: scores = softmax(logits) or sigmoid(logits); with num_groups > 1 only the best
    topk_groups groups stay eligible (a group's score: its best expert, or, with sigmoid scoring,
    its two best biased scores summed, as DeepSeek-V3); the top_k experts by (biased) score are
    picked; their unbiased scores are the weights, renormalized to sum 1 when norm_topk_prob,
    then multiplied by routed_scaling_factor."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    score_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (choice only, not weights)
    shared_intermediate_size: int = 0  # all shared experts as one MLP; 0: none

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(
                f"scoring_func={self.scoring!r} is not supported: expected softmax or sigmoid"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} is invalid: expected 1..{self.num_experts}"
            )
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"n_group={self.num_groups} is invalid: expected a divisor of {self.num_experts}"
            )
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"topk_group={self.topk_groups} is invalid: expected 1..n_group={self.num_groups}"
            )
        per_group = self.num_experts // self.num_groups
        if self.topk_groups * per_group < self.top_k:
            raise ValueError(
                f"topk_group={self.topk_groups} groups of {per_group} experts cannot hold "
                f"num_experts_per_tok={self.top_k}"
            )


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: per token the KV cache holds one latent of
    kv_lora_rank values (normed) plus one shared rotary key of qk_rope_head_dim values."""

    q_lora_rank: int | None  # None: a full-rank q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs are adjacent elements (DeepSeek's layout)

    @property
    def latent_dim(self) -> int:
        """Values one token stores per layer in the KV cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def moe_from_hf(
    cfg: dict[str, Any], family: str, num_layers: int
) -> tuple[MoEConfig | None, tuple[int, ...]]:
    """The router settings and the sparse layers of a MoE config.json (None for dense ones)."""
    if family == "mixtral":
        moe = MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,  # Mixtral always renormalizes its top-k
        )
        return moe, tuple(range(num_layers))
    if family == "qwen3_moe":
        moe = MoEConfig(
            num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
        dense = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return moe, layers
    if family not in MLA_FAMILIES:
        return None, ()
    v3 = family == "deepseek_v3"
    n_experts = cfg.get("n_routed_experts")
    if not n_experts:
        return None, ()
    topk_method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    grouped = topk_method in ("group_limited_greedy", "noaux_tc")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(
            f"topk_method={topk_method!r} is not supported: expected greedy, "
            "group_limited_greedy or noaux_tc"
        )
    shared = int(cfg.get("n_shared_experts") or 0)
    moe_size = int(cfg["moe_intermediate_size"])
    moe = MoEConfig(
        num_experts=int(n_experts),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=moe_size,
        scoring=scoring,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
        score_bias=topk_method == "noaux_tc",
        shared_intermediate_size=moe_size * shared,
    )
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    layers = tuple(i for i in range(first_dense, num_layers) if i % freq == 0)
    return moe, layers


def mla_from_hf(cfg: dict[str, Any]) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        # DeepSeek-V2's checkpoints always pair adjacent elements; V3 says so in its config.
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


# llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*).
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def deepseek2_from_gguf(
    key: Any, num_layers: int
) -> tuple[MLAConfig, MoEConfig | None, tuple[int, ...]]:
    """MLA and MoE settings of a llama.cpp `deepseek2` file. Newer converters write the MQA form
    (key_length = kv_lora_rank + rope, the per-head sizes in key_length_mla / value_length_mla),
    older ones the per-head sizes in key_length / value_length."""
    rope_dim = int(key("rope.dimension_count"))
    k_len = key("attention.key_length_mla") or key("attention.key_length")
    v_len = key("attention.value_length_mla") or key("attention.value_length")
    q_lora = key("attention.q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_nope_head_dim=int(k_len) - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(v_len),
    )
    n_experts = int(key("expert_count", 0) or 0)
    if not n_experts:
        return mla, None, ()
    gating = int(key("expert_gating_func", 1))
    if gating not in _GGUF_GATING:
        raise ValueError(f"GGUF expert_gating_func={gating} is not supported: expected 1 or 2")
    scoring = _GGUF_GATING[gating]
    groups = int(key("expert_group_count", 1) or 1)
    expert_size = int(key("expert_feed_forward_length"))
    moe = MoEConfig(
        num_experts=n_experts,
        top_k=int(key("expert_used_count")),
        intermediate_size=expert_size,
        scoring=scoring,
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
        num_groups=groups,
        topk_groups=int(key("expert_group_used_count", 1) or 1) if groups > 1 else 1,
        score_bias=scoring == "sigmoid",  # V3's exp_probs_b
        shared_intermediate_size=expert_size * int(key("expert_shared_count", 0) or 0),
    )
    first_dense = int(key("leading_dense_block_count", 0) or 0)
    return mla, moe, tuple(range(first_dense, num_layers))
