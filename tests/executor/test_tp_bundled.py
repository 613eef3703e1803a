"""The bundled Gemma 3 270M (GGUF blocks, one KV head replicated on both ranks) gives the same
20 greedy tokens with two tensor-parallel ranks as with one."""

from __future__ import annotations

import pytest

from tidal import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _tokens(**kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(kv_cache_bytes=32 << 20, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.slow  # two loads of the bundled model and 20 decode steps on each
def test_bundled_model_two_ranks_match_one() -> None:
    assert _tokens(tensor_parallel_size=2) == _tokens()
