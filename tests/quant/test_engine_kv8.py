"""memory.kv_cache_dtype through the engine: blocks per budget, greedy tokens, prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.engine_util import make_engine, run_to_completion
from tests.engine.tiny import make_tiny_model_dir
from tidal.attention.kv_quant import QuantizedKV
from tidal.engine.core import EngineCore
from tidal.sampling_params import SamplingParams

KV_BYTES = 4 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PREFIX = [1, *range(40, 80)]  # 41 tokens: 5 full pages of 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("kv8_engine"))


def _engine(tiny_dir: Path, kv_dtype: str, **kwargs: object) -> EngineCore:
    engine = make_engine(
        tiny_dir,
        kv_cache_bytes=KV_BYTES,
        kv_cache_dtype=kv_dtype,
        quantization_gate_max_tokens=32,
        **kwargs,
    )
    # NOTE: a failure, never a skip: an engine that stops applying memory.kv_cache_dtype is the
    # regression this file exists for. Both the layout and the pool the runner writes must be 8-bit.
    assert engine.layout.kv_dtype == kv_dtype
    k_pages, v_pages = engine.runner.kv_caches[0]
    for pages in (k_pages, v_pages):
        assert isinstance(pages, QuantizedKV) and pages.kv_dtype == kv_dtype
        assert pages.data.element_size() == 1
    return engine


def _generate(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    """One request after another, so later ones can hit the earlier ones' cached pages."""
    outs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
        final = run_to_completion(engine)
        outs.append(list(final[f"r{i}"].outputs[0].token_ids))
    return outs


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_blocks_per_budget_and_prefix_hits(tiny_dir: Path, kv_dtype: str) -> None:
    engine = _engine(tiny_dir, kv_dtype)
    float_engine = make_engine(tiny_dir, kv_cache_bytes=KV_BYTES)
    assert engine.num_blocks == KV_BYTES // engine.layout.page_bytes
    # Tiny model: head_dim 16, float32 -> (16 + 4) bytes vs 64 per (token, head): 3.2x the blocks.
    assert engine.layout.page_bytes * 64 == float_engine.layout.page_bytes * 20
    prompts = [PREFIX + [90, 91, 92], PREFIX + [95, 96]]
    hit = _generate(engine, prompts)
    assert engine.kv.prefix_hit_tokens >= 40  # the second prompt reused the 5 shared pages
    miss = _generate(_engine(tiny_dir, kv_dtype, enable_prefix_caching=False), prompts)
    assert hit == miss


def _bf16_engine(tiny_dir: Path, **kwargs: object) -> EngineCore:
    engine = make_engine(
        tiny_dir,
        kv_cache_bytes=KV_BYTES,
        kv_cache_dtype="bfloat16",
        quantization_gate_max_tokens=32,
        **kwargs,
    )
    assert engine.layout.kv_dtype == "bfloat16"
    for pages in engine.runner.kv_caches[0]:
        assert isinstance(pages, torch.Tensor) and pages.dtype == torch.bfloat16
    return engine


def test_bfloat16_pages_under_float32_compute(tiny_dir: Path) -> None:
    """memory.kv_cache_dtype bfloat16 with a float32 model: half the page bytes (twice the
    blocks), and the same greedy tokens with or without a prefix hit, alone or batched."""
    engine = _bf16_engine(tiny_dir)
    float_engine = make_engine(tiny_dir, kv_cache_bytes=KV_BYTES)
    assert engine.loaded.dtype == torch.float32
    assert engine.layout.page_bytes * 2 == float_engine.layout.page_bytes
    assert engine.num_blocks == KV_BYTES // engine.layout.page_bytes
    prompts = [PREFIX + [90, 91, 92], PREFIX + [95, 96], [1, *range(120, 133)]]
    hit = _generate(engine, prompts)
    assert engine.kv.prefix_hit_tokens >= 40
    assert hit == _generate(_bf16_engine(tiny_dir, enable_prefix_caching=False), prompts)
    batched = _bf16_engine(tiny_dir, enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        batched.add_request(f"r{i}", prompt, GREEDY)
    final = run_to_completion(batched)
    assert [list(final[f"r{i}"].outputs[0].token_ids) for i in range(3)] == hit


def test_bfloat16_pages_kernel_and_reference_agree(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C kernel rounds K/V to bfloat16 as torch's .to() does (nearest even), so the torch
    reference path, reading the same pages, gives the same greedy tokens."""
    from tidal.kernels import paged_attention as pa

    if not pa.available():
        pytest.skip("no C compiler: the engine runs the reference path only")
    prompts = [PREFIX + [90, 91, 92], [1, *range(120, 133)]]
    with_kernel = _generate(_bf16_engine(tiny_dir), prompts)
    monkeypatch.setattr(pa, "available", lambda: False)
    assert _generate(_bf16_engine(tiny_dir), prompts) == with_kernel
