"""Tiny GGUF files written with the `gguf` writer in llama.cpp's conventions (tensor names, Q/K row
permutation for llama-arch files, Gemma norms stored as 1 + w) load in tidal and match transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.paged import paged_prefill_and_greedy
from tidal.loader.model_loader import load_model

PROMPTS = [[5, 17, 33], [9, 2, 77, 41, 100, 3, 8, 64, 12, 7, 7, 90]]
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script: pair up the two rotary halves of every head."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _gguf_name(hf: str, family: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return None if family == "gemma3" else "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    gemma = {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    if family == "gemma3" and module in gemma:
        short = gemma[module]
    elif module == "post_attention_layernorm":
        short = "ffn_norm"
    else:
        short = _NAMES[module]
    return f"blk.{layer}.{short}.{kind}"


def write_gguf(hf_model, family: str, arch: str, path, matrix_type: str = "F16") -> None:
    """`matrix_type` "F16" or "Q8_0": how the 2-D tensors are stored."""
    import gguf

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", 1_000_000.0 if family == "gemma3" else 10000.0)
    if family == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", [f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_array("tokenizer.ggml.scores", [0.0] * cfg.vocab_size)
    w.add_array("tokenizer.ggml.token_type", [1] * cfg.vocab_size)
    for name, t in hf_model.state_dict().items():
        gname = _gguf_name(name, family)
        if gname is None:
            continue
        a = t.detach().float().numpy().copy()
        if family == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            a = _permute(a, heads)
        if a.ndim == 2 and matrix_type == "Q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(a, q8)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=q8)
        else:
            w.add_tensor(gname, a.astype(np.float16) if a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_model(family: str):
    import transformers as tf

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        head_dim=16,
    )
    if family == "gemma3":
        # GGUF keeps no layer pattern, local rope base or query_pre_attn_scalar: tidal takes
        # Gemma 3's defaults (every 6th layer global, 10k, head_dim), so the reference uses them.
        cfg = tf.Gemma3TextConfig(
            **common, num_hidden_layers=6, sliding_window=5, query_pre_attn_scalar=16
        )
    else:
        cfg = tf.LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p + torch.randn_like(p) * 0.2 if "norm" in name else torch.randn_like(p) * 0.15)
            if p.ndim == 2:  # the GGUF stores matrices as F16: compare on the same rounded values
                p.copy_(p.half().float())
    return model


@pytest.mark.parametrize("family,arch", [("gemma3", "gemma3"), ("llama", "llama")])
def test_tiny_gguf_matches_transformers(tmp_path, family, arch):
    hf = _hf_model(family)
    path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(hf, family, arch, path)
    loaded = load_model(path, torch.float32)
    assert loaded.arch.family == family
    logits, outs = paged_prefill_and_greedy(loaded.model, loaded.arch, PROMPTS, max_new=12)
    for prompt, ours, out in zip(PROMPTS, logits, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
            gen = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(prompt) :].tolist()
        diff = (ours - ref).abs().max().item()
        print(f"{family} gguf max|diff|={diff:.2e}")
        assert diff < 1e-4
        assert out == gen


@pytest.mark.parametrize("family,arch", [("gemma3", "gemma3"), ("llama", "llama")])
def test_tiny_gguf_blocks_match_the_float_load(tmp_path, family, arch):
    """Q8_0 matrices kept as the file's blocks (the CPU default) against the same file decoded to
    float: Llama's permuted Q/K block rows, an untied output.weight, the tied Gemma head."""
    from tidal.quant.gguf_blocks import GGUFLinear

    path = tmp_path / f"tiny-{family}-q8_0.gguf"
    write_gguf(_hf_model(family), family, arch, path, matrix_type="Q8_0")
    ref = load_model(path, torch.float32, weight_cache=False)
    ours = load_model(path, torch.float32, gguf_blocks=True)
    assert isinstance(ours.model.lm_head, GGUFLinear)
    assert isinstance(ours.model.model.layers[0].self_attn.qkv_proj, GGUFLinear)
    ref_logits, ref_outs = paged_prefill_and_greedy(ref.model, ref.arch, PROMPTS, max_new=12)
    logits, outs = paged_prefill_and_greedy(ours.model, ours.arch, PROMPTS, max_new=12)
    assert outs == ref_outs
    for a, b in zip(logits, ref_logits):
        assert (a - b).abs().max().item() < 1e-4
