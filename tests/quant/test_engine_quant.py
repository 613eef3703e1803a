"""`quantization` reaches the engine: LLM(quantization=...) serves the swapped model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny import make_tiny_model_dir
from tests.models.paged import paged_prefill_and_greedy
from tidal import LLM, SamplingParams
from tidal.config.model import ModelConfig
from tidal.loader.model_loader import load_model
from tidal.quant.int4 import Int4Linear
from tidal.quant.int8 import Int8Linear
from tidal.quant.registry import quantize_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_gemma_engine"))


def test_llm_generates_with_the_quantized_model(tiny_dir: Path) -> None:
    # The swap, not the gate, is under test (the gate refuses int4 on this random model: +1.3%).
    llm = LLM(str(tiny_dir), quantization="int4", kv_cache_bytes=1 << 22, quantization_gate=False)
    model = llm.engine.loaded.model
    # int4 keeps the LM head in int8 (tidal.quant.int4.quantize_head); the blocks are int4
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Int4Linear)
    prompt = [1, 40, 41, 42, 43]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    loaded = load_model(tiny_dir)
    quantize_model(loaded.model, "int4")
    _, expected = paged_prefill_and_greedy(loaded.model, loaded.arch, [prompt], 5)
    assert list(out[0].outputs[0].token_ids) == expected[0]


def test_config_rejects_unknown_scheme() -> None:
    with pytest.raises(
        ValueError, match="quantization=.int3. is invalid: expected one of auto, none"
    ):
        ModelConfig(quantization="int3")
