"""The module swap on tiny Gemma 3 (tied head) and Llama (untied) models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.models.paged import paged_prefill_and_greedy
from tests.models.tiny_hf import make_tiny_model
from tidal.config.quant import SCHEMES
from tidal.loader.model_loader import load_model
from tidal.quant.fp8 import Fp8Embedding
from tidal.quant.int8 import Int8Embedding, Int8Linear
from tidal.quant.registry import quantize_model, weight_bytes

PROMPTS = [[1, 17, 33, 90, 5, 64, 2, 8], [3, 99, 12]]
# Max |logit difference| against the same float model whose weights were replaced by the
# quantized modules' dequantized values: what is left is float32 summation order (the C kernels
# accumulate in float32 too), measured below 1e-5 for every scheme.
# (Against the original float weights the random tiny models move by 0.1-1.4: quantization error
# that the gate measures on the real model, not an implementation error.)
LOGIT_ATOL = {"int8": 1e-4, "int4": 1e-4, "fp8": 1e-4, "int8-dequant": 1e-4}


def _fake_quantized(path: Path, quantized: nn.Module) -> nn.Module:
    """The float model with every quantized weight replaced by its dequantized value."""
    model = load_model(path).model
    swapped = dict(quantized.named_modules())
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(swapped[name].dequantize())
    vocab = model.model.embed_tokens.num_embeddings
    rows = quantized.model.embed_tokens(torch.arange(vocab))  # (vocab, hidden)
    model.model.embed_tokens = nn.Embedding.from_pretrained(rows)
    return model


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, out)
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8", "int8-dequant"])
def test_swap_keeps_logits_close(tiny: Path, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if scheme == "int8-dequant":
        monkeypatch.setattr("tidal.quant.int8.KERNEL_MAX_ROWS", 0)  # the portable path only
    loaded = load_model(tiny)
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    summary = quantize_model(loaded.model, scheme.removesuffix("-dequant"))
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    # per layer: the fused q/k/v, o, the fused gate/up and down; plus the LM head
    assert summary.num_linear == 1 + 4 * loaded.arch.num_layers
    assert summary.weight_bytes_after == weight_bytes(loaded.model) < summary.weight_bytes_before
    embed = loaded.model.model.embed_tokens
    if tied:
        assert not isinstance(embed, nn.Embedding)  # the float table is gone
        if scheme.startswith("int8"):
            assert isinstance(embed, Int8Embedding) and isinstance(loaded.model.lm_head, Int8Linear)
            assert embed.codes is loaded.model.lm_head.codes  # one int8 copy
        if scheme == "fp8":
            assert isinstance(embed, Fp8Embedding) and embed.codes is loaded.model.lm_head.codes
    else:
        assert isinstance(embed, nn.Embedding)
    logits, _ = paged_prefill_and_greedy(loaded.model, loaded.arch, PROMPTS, 2)
    reference = _fake_quantized(tiny, loaded.model)
    ref_logits, _ = paged_prefill_and_greedy(reference, loaded.arch, PROMPTS, 2)
    for a, b in zip(ref_logits, logits, strict=True):
        diff = (a - b).abs().max().item()
        print(f"{scheme} max |logit diff| {diff:.2e}")
        assert diff < LOGIT_ATOL[scheme]


def test_none_and_unknown(tiny: Path) -> None:
    loaded = load_model(tiny)
    before = weight_bytes(loaded.model)
    assert quantize_model(loaded.model, "none").weight_bytes_after == before
    assert SCHEMES == ("auto", "none", "gguf", "gguf-q8", "int8", "int4", "fp8")
    with pytest.raises(ValueError, match="quantization='q2' is invalid: expected one of auto"):
        quantize_model(loaded.model, "q2")
    with pytest.raises(ValueError, match="quantization='auto' must be resolved first"):
        quantize_model(loaded.model, "auto")
