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
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
