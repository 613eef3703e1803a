"""An engine built decode-only (the engine process of `tidal serve`) holds a TokenDecoder and gives
the same text, stop-string cuts, logprob texts and constrained output as one with the full
tokenizer; the engine process's warm-up runs on it."""

from __future__ import annotations

import json

from tests.engine.engine_util import run_to_completion
from tests.kv.pool_check import FakeClock
from tidal.engine.builder import build_engine
from tidal.engine.llm import engine_config_from_kwargs
from tidal.engine.process import _warm_up
from tidal.loader.token_decoder import TokenDecoder
from tidal.loader.tokenizer import Tokenizer
from tidal.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a"], "additionalProperties": False}  # fmt: skip
PROMPTS = ["Hello world", "The tide comes in", "def add(a, b):"]


def _engine(model_dir, decode_only: bool):
    config = engine_config_from_kwargs(str(model_dir), kv_cache_bytes=8 << 20, block_size=8)
    return build_engine(config, clock=FakeClock(1000.0), decode_only=decode_only)


def _outputs(engine, prompt_ids: list[list[int]]) -> list[tuple]:
    params = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2),
        SamplingParams(
            temperature=0, max_tokens=24, stop=["d", "0", "<<<"], include_stop_str_in_output=False
        ),
        SamplingParams(
            temperature=0,
            max_tokens=16,
            structured_outputs=StructuredOutputs("json", json.dumps(SCHEMA)),
        ),
    ]
    for i, ids in enumerate(prompt_ids):
        for j, p in enumerate(params):
            engine.add_request(f"r{i}-{j}", ids, p)
    final = run_to_completion(engine)
    rows = []
    for rid in sorted(final):
        c = final[rid].outputs[0]
        texts = None
        if c.logprobs:
            texts = [[lp.decoded_token for lp in pos.values()] for pos in c.logprobs]
        rows.append((rid, c.text, list(c.token_ids), c.finish_reason, texts))
    return rows


def test_decode_only_engine_matches_the_full_tokenizer(tiny_model_dir) -> None:
    full = _engine(tiny_model_dir, decode_only=False)
    compact = _engine(tiny_model_dir, decode_only=True)
    assert isinstance(full.tokenizer, Tokenizer)
    assert isinstance(compact.tokenizer, TokenDecoder)
    assert compact.eos_token_ids == full.eos_token_ids
    prompt_ids = [full.tokenizer.encode(p) for p in PROMPTS]
    expected = _outputs(full, prompt_ids)
    assert _outputs(compact, prompt_ids) == expected
    # Stop strings cut the text of every second request (the tiny model's outputs contain them).
    assert all(reason == "stop" for rid, _, _, reason, _ in expected if rid.endswith("-1"))
    # The constrained requests parsed: the grammar tokenizer came from load_full().
    assert compact.tokenizer._full is not None
    for rid, text, *_ in expected:
        if rid.endswith("-2"):
            json.loads(text)
    _warm_up(compact)
    assert not compact.has_unfinished()
