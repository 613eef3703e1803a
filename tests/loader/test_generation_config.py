"""The checkpoint's recommended sampling (generation_config.json, a GGUF's general.sampling.*),
the model.generation_config / override_generation_config settings, and what a request's unset
fields become."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tidal.config.loader import load_config
from tidal.config.model import ModelConfig
from tidal.loader.generation_config import sampling_defaults
from tidal.server.protocol import ChatCompletionRequest, CompletionRequest

# DeepSeek-R1-Distill-Qwen's generation_config.json, with the nulls and token ids HF writes
R1_DISTILL = {
    "_from_model_config": True,
    "bos_token_id": 151646,
    "eos_token_id": 151643,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": None,
    "transformers_version": "4.44.0",
}


def _hf_dir(tmp_path: Path, gen: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def _gguf(path: Path, keys: dict[str, tuple[str, object]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in keys.items():
        getattr(writer, f"add_{kind}")(key, value)
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_hf_checkpoint_recommends_what_its_generation_config_sets(tmp_path: Path) -> None:
    root = _hf_dir(tmp_path, {**R1_DISTILL, "max_new_tokens": 2048, "repetition_penalty": 1.05})
    params, source = sampling_defaults(ModelConfig(), root)
    # null fields, do_sample and token ids are not recommendations; max_new_tokens is max_tokens
    assert params == {
        "temperature": 0.6,
        "top_p": 0.95,
        "repetition_penalty": 1.05,
        "max_tokens": 2048,
    }
    assert source == str(root / "generation_config.json")


def test_a_gguf_recommends_llama_cpp_general_sampling_keys(tmp_path: Path) -> None:
    path = _gguf(
        tmp_path / "m.gguf",
        {
            "general.sampling.temp": ("float32", 0.6),
            "general.sampling.top_p": ("float32", 0.95),
            "general.sampling.top_k": ("int32", 20),
            "general.sampling.min_p": ("float32", 0.05),
            "general.sampling.penalty_repeat": ("float32", 1.05),
            "general.sampling.mirostat": ("int32", 2),  # a sampler tidal does not have
        },
    )
    params, source = sampling_defaults(ModelConfig(), path)
    # float32 values come back as the numbers written, not 0.6000000238418579
    assert params == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
    }
    assert "general.sampling" in source


def test_checkpoints_without_a_recommendation_keep_openai_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(ModelConfig(), _gguf(tmp_path / "m.gguf", {})) == ({}, "")
    plain = _hf_dir(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
    assert sampling_defaults(ModelConfig(), plain) == ({}, "")
    assert sampling_defaults(ModelConfig(), tmp_path / "empty_dir_missing") == ({}, "")


def test_none_a_folder_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    model = _hf_dir(tmp_path / "model", R1_DISTILL)
    other = tmp_path / "other"
    other.mkdir()
    _hf_dir(other, {"temperature": 0.3})
    none = ModelConfig(generation_config="none")
    assert sampling_defaults(none, model) == ({}, "")
    assert sampling_defaults(ModelConfig(generation_config=str(other)), model)[0] == {
        "temperature": 0.3
    }
    as_file = ModelConfig(generation_config=str(other / "generation_config.json"))
    assert sampling_defaults(as_file, model)[0] == {"temperature": 0.3}
    over = ModelConfig(override_generation_config='{"temperature": 0.2, "max_new_tokens": 64}')
    assert sampling_defaults(over, model)[0] == {
        "temperature": 0.2,
        "top_p": 0.95,
        "max_tokens": 64,
    }
    # with none, the override alone (vLLM's --generation-config vllm plus an override)
    only = ModelConfig(generation_config="none", override_generation_config={"top_k": 40})
    assert sampling_defaults(only, model) == ({"top_k": 40}, "override_generation_config")


def test_bad_recommendations_are_refused_naming_where_they_came_from(tmp_path: Path) -> None:
    root = _hf_dir(tmp_path, {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p=1.5 is invalid"):
        sampling_defaults(ModelConfig(), root)
    _hf_dir(tmp_path, {"top_k": 2.5})
    with pytest.raises(ValueError, match=r"top_k=2.5 is invalid: expected a whole number"):
        sampling_defaults(ModelConfig(), root)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable generation config"):
        sampling_defaults(ModelConfig(), root)
    # an override may mend it
    fixed = ModelConfig(generation_config="none", override_generation_config='{"top_p": 0.9}')
    assert sampling_defaults(fixed, root)[0] == {"top_p": 0.9}
    with pytest.raises(ValueError, match="expected auto, none, or a folder"):
        sampling_defaults(ModelConfig(generation_config=str(tmp_path / "nowhere")), root)
    path = _gguf(tmp_path / "m.gguf", {"general.sampling.temp": ("string", "warm")})
    with pytest.raises(ValueError, match=r"m.gguf \(general.sampling.\*\): temperature='warm'"):
        sampling_defaults(ModelConfig(), path)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "a JSON object"),
        ("[0.5]", "a JSON object"),
        ('{"temp": 0.5}', "keys among temperature, top_p"),
        ('{"top_p": "high"}', "a number for 'top_p'"),
        ('{"top_p": true}', "a number for 'top_p'"),
    ],
)
def test_override_generation_config_is_checked_with_the_config(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"override_generation_config=.*{says}"):
        ModelConfig(override_generation_config=text)


def test_yaml_takes_the_override_as_a_mapping_and_the_flag_as_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text("model:\n  override_generation_config: {temperature: 0.5}\n")
    cfg = load_config(str(yaml_file), {}, {})
    assert cfg.engine.model.generation_overrides() == {"temperature": 0.5}
    cfg = load_config(None, {}, {"model.override_generation_config": '{"top_k": 5}'})
    assert cfg.engine.model.generation_overrides() == {"top_k": 5}
    env = {"TIDAL_MODEL_GENERATION_CONFIG": "none"}
    assert load_config(None, env, {}).engine.model.generation_config == "none"


def _completion(**body: object) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps(body))


def _chat(**body: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


def test_unset_request_fields_take_the_recommendation_set_ones_win() -> None:
    unset = _completion(prompt="x").to_sampling_params(RECOMMENDED)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (
        0.6,
        0.95,
        20,
        1.05,
    )
    assert unset.max_tokens == 16  # left out: OpenAI's 16 for completions
    null = _completion(prompt="x", temperature=None, top_k=None)
    assert null.to_sampling_params(RECOMMENDED).temperature == 0.6  # null is unset
    given = _completion(prompt="x", temperature=0.0, top_p=1.0, top_k=0)
    params = given.to_sampling_params(RECOMMENDED)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, 0)
    assert params.repetition_penalty == 1.05
    # without a recommendation, OpenAI's defaults
    plain = _completion(prompt="x").to_sampling_params()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1, 1, 0, 1)


def test_max_new_tokens_bounds_only_requests_that_set_no_limit() -> None:
    rec = {"max_tokens": 64}
    messages = [{"role": "user", "content": "hi"}]
    assert _chat(messages=messages).to_sampling_params(rec).max_tokens == 64
    assert _chat(messages=messages).to_sampling_params().max_tokens is None
    asked = _chat(messages=messages, max_completion_tokens=500)
    assert asked.to_sampling_params(rec).max_tokens == 500
    assert _completion(prompt="x", max_tokens=None).to_sampling_params(rec).max_tokens == 64
    assert _completion(prompt="x", max_tokens=100).to_sampling_params(rec).max_tokens == 100
