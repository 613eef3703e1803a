"""Every family against transformers on tiny random configs: a ragged batch through paged attention
must match transformers run one sequence at a time (logits 1e-4, greedy tokens exact)."""

from __future__ import annotations

import pytest
import torch

from tests.models.paged import paged_prefill_and_greedy
from tests.models.tiny_hf import hf_references, make_tiny_model
from tidal.loader.model_loader import load_model

FAMILIES = ["gemma3", "llama", "qwen2", "qwen3", "mistral"]
PROMPTS = [
    [5, 17, 33],
    [9, 2, 77, 41, 100, 3, 8, 64, 12],
    [1, 90, 45, 45, 7, 120, 33, 18, 2, 99, 6, 71, 30, 11],
]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    refs = hf_references(hf, PROMPTS, 20)
    return request.param, hf, load_model(path, torch.float32), refs


@pytest.mark.parametrize("chunk", [None, 4])
def test_logits_and_greedy_match_transformers(tiny, chunk):
    family, _, loaded, refs = tiny
    logits, outs = paged_prefill_and_greedy(
        loaded.model, loaded.arch, PROMPTS, max_new=20, chunk=chunk
    )
    for prompt, ours, out, (ref, gen) in zip(PROMPTS, logits, outs, refs):
        diff = (ours - ref).abs().max().item()
        print(f"{family} chunk={chunk} len={len(prompt)} max|diff|={diff:.2e}")
        assert diff < 1e-4
        assert out == gen


def test_arch_is_read_from_config(tiny):
    family, hf, loaded, _ = tiny
    arch = loaded.arch
    assert arch.family == family
    assert arch.num_layers == hf.config.num_hidden_layers
    if family == "gemma3":
        assert arch.layer_types == tuple(hf.config.layer_types)
        assert arch.sliding_window == 5 and arch.tie_word_embeddings
        assert arch.rope["sliding_attention"].theta == 10000.0
        assert arch.rope["full_attention"].theta == 1_000_000.0
    if family == "mistral":
        assert set(arch.layer_types) == {"sliding_attention"} and arch.sliding_window == 5
    if family == "qwen2":
        assert arch.qkv_bias
    if family == "qwen3":
        assert arch.qk_norm and arch.head_dim == 24
