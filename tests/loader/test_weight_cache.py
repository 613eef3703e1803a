"""The GGUF weight cache: a cached load is bit-identical to dequantizing, and goes stale when it must."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.models.paged import paged_prefill_and_greedy
from tidal.config.model import ModelConfig
from tidal.loader import weight_cache
from tidal.loader.model_loader import load_model
from tidal.loader.weight_cache import weight_cache_key, weight_cache_path

PROMPTS = [[5, 17, 33], [9, 2, 40, 41, 60, 3, 8]]
V, H, FF, NH, NKV, HD, LAYERS = 64, 256, 512, 2, 1, 128, 2
Q = gguf.GGMLQuantizationType
# Where each type made of random blocks keeps its fp16 scales (set small and finite below).
_FP16_AT = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}
# The matrices' storage in write_tiny_quantized_gemma, by GGUF tensor role.
MATRIX_TYPES = {
    "attn_q": Q.Q5_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K,
}  # fmt: skip


def _blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks with small finite scales, (rows, bytes per row) uint8."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for at in _FP16_AT[qtype]:
        # IQ4's codes reach 127 (times a 6-bit sub-scale for IQ4_XS): a smaller d keeps the
        # weights of the K-quants' size
        small = 1e-4 if qtype in (Q.IQ4_NL, Q.IQ4_XS) else 1e-3
        halves = (rng.standard_normal(blocks.shape[0]) * small).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_quantized_gemma(
    path: Path, seed: int = 0, types: dict[str, gguf.GGMLQuantizationType] | None = None
) -> None:
    """A 2-layer Gemma 3 GGUF whose tensors use Q8_0, Q5_0, Q4_K, Q6_K and F32 storage; `types`
    overrides MATRIX_TYPES's storage of some matrices (by role: "attn_q", "ffn_down", ...)."""
    roles = {**MATRIX_TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    a = "gemma3"
    for key, value in {
        "block_count": LAYERS,
        "context_length": 256,
        "embedding_length": H,
        "feed_forward_length": FF,
        "attention.head_count": NH,
        "attention.head_count_kv": NKV,
        "attention.key_length": HD,
        "attention.value_length": HD,
        "attention.sliding_window": 8,
    }.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 1_000_000.0)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", [f"<t{i}>" for i in range(V)])
    w.add_array("tokenizer.ggml.scores", [0.0] * V)
    w.add_array("tokenizer.ggml.token_type", [1] * V)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def quantized(name: str, qtype, rows: int, cols: int) -> None:
        if qtype in _FP16_AT:
            data = _blocks(qtype, rows, cols, rng)
        else:
            data = gguf.quants.quantize(normal(rows, cols), qtype)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    quantized("token_embd.weight", Q.Q8_0, V, H)
    w.add_tensor("output_norm.weight", 1.0 + normal(H))
    for i in range(LAYERS):
        b = f"blk.{i}"
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(f"{b}.{norm}.weight", 1.0 + normal(H))
        w.add_tensor(f"{b}.attn_q_norm.weight", 1.0 + normal(HD))
        w.add_tensor(f"{b}.attn_k_norm.weight", 1.0 + normal(HD))
        for role, (rows, cols) in {
            "attn_q": (NH * HD, H), "attn_k": (NKV * HD, H), "attn_v": (NKV * HD, H),
            "attn_output": (H, NH * HD), "ffn_gate": (FF, H), "ffn_up": (FF, H),
            "ffn_down": (H, FF),
        }.items():  # fmt: skip
            quantized(f"{b}.{role}.weight", roles[role], rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    return path


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in model.state_dict().items()}


def _assert_identical(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    a, b = _state(ours), _state(ref)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    # The tied Gemma head still shares the embedding's storage.
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def _source(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if "model loaded from" in r.getMessage()]
    return "cache" if "weights from the weight cache" in lines[-1] else "checkpoint"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cached_load_is_bit_identical_to_dequantizing(
    tiny_gguf: Path, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ref = load_model(tiny_gguf, dtype, weight_cache=False)
    cache = weight_cache_path(tiny_gguf, dtype)
    assert not cache.exists()
    first = load_model(tiny_gguf, dtype)  # dequantizes and writes the cache
    assert _source(caplog) == "checkpoint" and cache.exists()
    cached = load_model(tiny_gguf, dtype)
    assert _source(caplog) == "cache"
    _assert_identical(first.model, ref.model)
    _assert_identical(cached.model, ref.model)
    # Same greedy tokens (and logits) from the model on cached weights.
    ref_logits, ref_tokens = paged_prefill_and_greedy(ref.model, ref.arch, PROMPTS, max_new=8)
    logits, tokens = paged_prefill_and_greedy(cached.model, cached.arch, PROMPTS, max_new=8)
    assert tokens == ref_tokens
    for ours, theirs in zip(logits, ref_logits):
        assert torch.equal(ours, theirs)
    # No temp file is left beside the GGUF; one cache file per dtype.
    assert sorted(p.name for p in tiny_gguf.parent.iterdir()) == sorted(
        [tiny_gguf.name, cache.name]
    )


def test_cache_is_off_when_asked(tiny_gguf: Path) -> None:
    load_model(tiny_gguf, weight_cache=False)
    assert not weight_cache_path(tiny_gguf, torch.float32).exists()


def test_writes_to_cached_tensors_never_reach_the_file(tiny_gguf: Path) -> None:
    ref = load_model(tiny_gguf, weight_cache=False)
    load_model(tiny_gguf)
    cached = load_model(tiny_gguf)
    cached.model.model.norm.weight.add_(1.0)  # copy-on-write mapping
    again = load_model(tiny_gguf)
    assert torch.equal(again.model.model.norm.weight, ref.model.model.norm.weight)


def test_a_changed_gguf_makes_the_cache_stale(
    tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    load_model(tiny_gguf)
    write_tiny_quantized_gemma(tiny_gguf, seed=1)  # new weights
    ref = load_model(tiny_gguf, weight_cache=False)
    fresh = load_model(tiny_gguf)
    assert any("is stale" in r.getMessage() for r in caplog.records)
    assert _source(caplog) == "checkpoint"
    _assert_identical(fresh.model, ref.model)
    # The rewritten cache carries the new file's key, and the next load uses it.
    from safetensors import safe_open

    with safe_open(weight_cache_path(tiny_gguf, torch.float32), framework="pt") as f:
        assert f.metadata() == weight_cache_key(tiny_gguf, torch.float32).as_metadata()
    _assert_identical(load_model(tiny_gguf).model, ref.model)
    assert _source(caplog) == "cache"


def test_a_touched_gguf_or_a_new_loader_version_makes_the_cache_stale(
    tiny_gguf: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    load_model(tiny_gguf)
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    load_model(tiny_gguf)
    assert _source(caplog) == "checkpoint"
    monkeypatch.setattr(weight_cache, "LOADER_VERSION", weight_cache.LOADER_VERSION + "-next")
    load_model(tiny_gguf)
    assert _source(caplog) == "checkpoint"
    load_model(tiny_gguf)
    assert _source(caplog) == "cache"


def test_the_stamp_sha_is_part_of_the_key(tiny_gguf: Path) -> None:
    before = weight_cache_key(tiny_gguf, torch.float32)
    assert before.gguf_sha256 == ""
    stamp = tiny_gguf.with_name(tiny_gguf.name + ".stamp.json")
    stamp.write_text('{"sha256": "ab12"}')
    after = weight_cache_key(tiny_gguf, torch.float32)
    assert after.gguf_sha256 == "ab12" and after != before


def test_a_corrupt_cache_falls_back_and_is_rewritten(
    tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ref = load_model(tiny_gguf, weight_cache=False)
    load_model(tiny_gguf)
    cache = weight_cache_path(tiny_gguf, torch.float32)
    cache.write_bytes(cache.read_bytes()[:1000])  # truncated
    _assert_identical(load_model(tiny_gguf).model, ref.model)
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    _assert_identical(load_model(tiny_gguf).model, ref.model)
    assert _source(caplog) == "cache"


def test_temp_files_of_dead_writers_are_removed(tiny_gguf: Path) -> None:
    cache = weight_cache_path(tiny_gguf, torch.float32)
    dead = tiny_gguf.parent / f".{cache.name}.{2**22 + 12345}.x1y2.partial"  # above pid_max
    live = tiny_gguf.parent / f".{cache.name}.{os.getpid()}.abcd.partial"
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    load_model(tiny_gguf)
    assert not dead.exists() and live.exists()


def test_config_key_is_a_bool() -> None:
    assert ModelConfig().weight_cache is True
    with pytest.raises(ValueError, match="weight_cache='yes' is invalid: expected true or false"):
        ModelConfig(weight_cache="yes")  # type: ignore[arg-type]
