"""Tiny random transformers models per family, saved as safetensors, for reference tests."""

from __future__ import annotations

from pathlib import Path

import torch

SLIDING, FULL = "sliding_attention", "full_attention"
_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(family: str, vocab_size: int = 128):
    import transformers as tf

    COMMON = {**_COMMON, "vocab_size": vocab_size}

    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **{**COMMON, "tie_word_embeddings": True},
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=5,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            final_logit_softcapping=30.0,
        )
    if family == "llama":
        return tf.LlamaConfig(
            **COMMON,
            num_hidden_layers=3,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            },
        )
    if family == "qwen2":
        return tf.Qwen2Config(**COMMON, num_hidden_layers=2)
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=24)
    if family == "mistral":
        return tf.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=5)
    if family in MOE_FAMILIES:
        return _moe_config(family, COMMON)
    raise ValueError(family)


# Mixture-of-experts families (tests/models/test_moe_vs_transformers.py). The DeepSeek ones use
# MLA; "deepseek_v2_lite" has no q_lora_rank, as DeepSeek-V2-Lite.
MOE_FAMILIES = ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "qwen3_moe", "mixtral")
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
# YaRN with distinct mscales: the cos/sin factor (mscale / mscale_all_dim) and the softmax
# scale's mscale_all_dim**2 both differ from 1.
_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "rope_theta": 10000.0,
}


def _moe_config(family: str, common: dict):
    import transformers as tf

    moe = {**common, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
    mla = {**moe, **_MLA, "num_key_value_heads": common["num_attention_heads"]}  # MLA: no GQA
    if family == "deepseek_v2_lite":
        return tf.DeepseekV2Config(
            **mla, num_hidden_layers=2, q_lora_rank=None, n_routed_experts=8,
            n_shared_experts=2, first_k_dense_replace=1,
        )  # fmt: skip
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(
            **mla, num_hidden_layers=2, q_lora_rank=24, n_routed_experts=8,
            n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            routed_scaling_factor=1.5, rope_parameters=_YARN,
        )  # fmt: skip
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **mla, num_hidden_layers=3, q_lora_rank=24, n_routed_experts=8,
            n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, rope_parameters=_YARN,
        )  # fmt: skip
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **moe, num_hidden_layers=3, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1]
        )
    if family == "mixtral":
        return tf.MixtralConfig(**moe, num_hidden_layers=2, num_local_experts=4, sliding_window=5)
    raise ValueError(family)


def make_tiny_model(family: str, out_dir: Path, seed: int = 0, vocab_size: int = 128):
    """A transformers model with weights large enough that attention patterns matter."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size)
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif p.ndim == 1:  # biases
                p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 routing bias
                b.normal_(0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def hf_references(
    hf, prompts: list[list[int]], max_new: int
) -> list[tuple[torch.Tensor, list[int]]]:
    """Per prompt, transformers' float32 logits over it and its `max_new` greedy tokens (EOS
    ignored): the reference a tidal model run through the paged cache must reproduce."""
    refs = []
    with torch.no_grad():
        for prompt in prompts:
            logits = hf(torch.tensor([prompt])).logits[0].float()
            gen = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                min_new_tokens=max_new,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(prompt) :].tolist()
            refs.append((logits, gen))
    return refs
