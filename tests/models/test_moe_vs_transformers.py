"""The MoE families (DeepSeek V2 / V2-Lite / V3 with MLA, Qwen3-MoE, Mixtral) against transformers
on tiny random configs: a ragged batch through the paged (latent) KV cache, chunked or not, must
match transformers run one sequence at a time (logits 1e-4, 20 greedy tokens exact)."""

from __future__ import annotations

import pytest
import torch

from tests.models.paged import PagedBatch, paged_prefill, paged_prefill_and_greedy
from tests.models.tiny_hf import MOE_FAMILIES, hf_references, make_tiny_model
from tidal.layers.mla_attention import MLAttention
from tidal.layers.moe import SparseMoE
from tidal.loader.model_loader import load_model

PROMPTS = [
    [5, 17, 33],
    [9, 2, 77, 41, 100, 3, 8, 64, 12],
    [1, 90, 45, 45, 7, 120, 33, 18, 2, 99, 6, 71, 30, 11],
]
MAX_NEW = 20


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    refs = hf_references(hf, PROMPTS, MAX_NEW)
    return request.param, hf, load_model(path, torch.float32), refs


@pytest.mark.parametrize("chunk", [None, 4])
def test_logits_and_greedy_match_transformers(tiny, chunk):
    family, _, loaded, refs = tiny
    logits, outs = paged_prefill_and_greedy(
        loaded.model, loaded.arch, PROMPTS, max_new=MAX_NEW, chunk=chunk
    )
    for prompt, ours, out, (ref, gen) in zip(PROMPTS, logits, outs, refs):
        diff = (ours - ref).abs().max().item()
        print(f"{family} chunk={chunk} len={len(prompt)} max|diff|={diff:.2e}")
        assert diff < 1e-4
        assert out == gen


def test_prefix_hit_reads_the_cached_latents(tiny):
    """Sequence 1 shares sequence 0's first two pages (a prefix-cache hit: it computes only its
    tail over KV another sequence wrote); its logits still match transformers on the whole
    prompt."""
    family, _, loaded, refs = tiny
    batch = PagedBatch(loaded.model, loaded.arch, max_len=32, num_seqs=2)
    long = PROMPTS[2]
    paged_prefill(batch, [long[:8]])  # sequence 0 writes positions 0..7 (pages 0 and 1)
    hit = 8  # two pages of block_size 4
    batch.tables[1] = [t[:2] + t1[2:] for t, t1 in zip(batch.tables[0], batch.tables[1])]
    tail = batch.step([long[hit:]], [hit], [1])  # (len - hit, vocab)
    diff = (tail - refs[2][0][hit:]).abs().max().item()
    print(f"{family} prefix hit of {hit} tokens: max|diff|={diff:.2e}")
    assert diff < 1e-4


def test_arch_is_read_from_config(tiny):
    family, hf, loaded, _ = tiny
    arch, cfg = loaded.arch, hf.config
    assert arch.moe is not None
    model = loaded.model
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert tuple(sparse) == arch.moe_layers
    if family.startswith("deepseek"):
        assert arch.mla is not None and arch.mla.kv_lora_rank == cfg.kv_lora_rank
        assert arch.mla.q_lora_rank == cfg.q_lora_rank
        assert sparse == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
        attn = model.model.layers[0].self_attn
        assert isinstance(attn, MLAttention) and not hasattr(attn, "kv_b_proj")  # split on load
        assert arch.moe.shared_intermediate_size == cfg.moe_intermediate_size * cfg.n_shared_experts
    if family == "deepseek_v3":
        assert arch.moe.scoring == "sigmoid" and arch.moe.score_bias and arch.moe.num_groups == 4
    if family == "deepseek_v2":
        assert arch.moe.scoring == "softmax" and arch.moe.num_groups == 4
    if family == "qwen3_moe":
        assert sparse == [0, 2] and arch.qk_norm and arch.moe.norm_topk_prob
    if family == "mixtral":
        assert arch.moe.num_experts == 4 and arch.moe.norm_topk_prob
        assert set(arch.layer_types) == {"sliding_attention"} and arch.sliding_window == 5


@pytest.mark.parametrize(
    "change,message",
    [
        ({"topk_method": "random"}, "topk_method='random' is not supported"),
        ({"scoring_func": "relu"}, "scoring_func='relu' is not supported"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is invalid: expected 1..8"),
        ({"n_group": 3}, "n_group=3 is invalid: expected a divisor of 8"),
        ({"topk_group": 5}, "topk_group=5 is invalid: expected 1..n_group=4"),
    ],
)
def test_bad_moe_settings_are_refused_with_the_field_name(change, message):
    from tests.models.tiny_hf import tiny_config
    from tidal.config.arch import arch_from_hf

    cfg = tiny_config("deepseek_v3").to_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        arch_from_hf(cfg)


def test_a_pre_quantized_checkpoint_is_refused():
    """DeepSeek-V3/R1's own FP8 checkpoints (per-block scales) cannot be read as floats."""
    from tests.models.tiny_hf import tiny_config
    from tidal.config.arch import arch_from_hf

    cfg = tiny_config("deepseek_v3").to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="quant_method='fp8' is not supported"):
        arch_from_hf(cfg)
