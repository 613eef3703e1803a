"""Constrained decoding in the engine: outputs match their grammar; unconstrained rows sharing the
batch are unchanged; alone, batched, chunked, preempted, with a prefix hit and with n > 1 a
constrained request's tokens are the same; max_tokens inside a structure ends with "length"."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from tests.kv.pool_check import assert_pool_clean
from tidal import LLM, SamplingParams
from tidal.layers.sampler import Sampler, SamplingRow
from tidal.sampling_params import StructuredOutputs
from tidal.structured.grammar import closed
from tidal.structured.matchers import bitmask_words

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutputs("json", json.dumps(SCHEMA))
REGEX = r"[a-z]{2,4}-[0-9]{2}"
PROMPTS = ["Hello world", "The tide comes in", "def add(a, b):", "Numbers like 1234"]


def _params(spec: StructuredOutputs | None, **kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", 48)
    return SamplingParams(temperature=0, structured_outputs=spec, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), kv_cache_bytes=8 << 20, block_size=8)


def test_json_schema_regex_and_choice_outputs_match(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, _params(JSON_SPEC))
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for out in llm.generate(PROMPTS, _params(StructuredOutputs("regex", REGEX))):
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
    choices = ["yes", "no", "maybe so"]
    for out in llm.generate(PROMPTS, _params(StructuredOutputs("choice", json.dumps(choices)))):
        assert out.outputs[0].text in choices
    grammar = 'root ::= "(" [0-9] ("+" [0-9])* ")"'
    for out in llm.generate(PROMPTS, _params(StructuredOutputs("grammar", grammar))):
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", out.outputs[0].text), out.outputs[0].text
    assert_pool_clean(llm.engine.kv)


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(llm: LLM) -> None:
    plain = _params(None, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = [llm.generate([p], plain)[0].outputs[0] for p in PROMPTS]
    mixed = llm.generate(PROMPTS * 2, [plain] * len(PROMPTS) + [_params(JSON_SPEC)] * len(PROMPTS))
    for a, b in zip(alone, mixed[: len(PROMPTS)], strict=True):
        assert a.token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.logprobs, b.outputs[0].logprobs, strict=True):
            # Batch shape moves float32 logits by ~1e-6 (as in test_batch_invariance).
            for tid, lp in la.items():
                assert abs(lp.logprob - lb[tid].logprob) < 1e-4


@pytest.mark.parametrize(
    "name,kwargs",
    [
        # chunked prefill, decode rows beside prefill chunks
        ("chunked", dict(max_num_batched_tokens=8, max_num_seqs=8)),
        # too little KV: requests are preempted and recomputed with their outputs kept
        ("preempted", dict(kv_cache_bytes=64 << 10, max_num_seqs=8)),
    ],
)
def test_constrained_tokens_same_alone_batched_chunked_preempted(tiny_model_dir, llm, name, kwargs):
    params = [_params(JSON_SPEC), _params(StructuredOutputs("regex", REGEX))] * 4
    prompts = [p * 3 for p in PROMPTS] * 2
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    again = llm.generate(prompts, params)  # batched, and a prefix hit on each prompt
    assert [o.outputs[0].token_ids for o in again] == alone
    other = LLM(str(tiny_model_dir), block_size=8, **{"kv_cache_bytes": 8 << 20, **kwargs})
    outs = other.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == alone
    if name == "preempted":
        assert other.engine.last_stats.num_preemptions_total > 0
    assert_pool_clean(other.engine.kv)
    assert other.engine.runner.grammars.num_tracked == 0  # every matcher released


def test_sampled_choices_each_match_and_stop_strings_cut(llm: LLM) -> None:
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=48, structured_outputs=JSON_SPEC
    )
    out = llm.generate(["Hello world"], params)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    cut = llm.generate(["Hello world"], _params(JSON_SPEC, stop=['"age"']))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"'
    assert cut.text.startswith('{"name": ') and '"age"' not in cut.text


def test_max_tokens_inside_a_structure_finishes_with_length(llm: LLM) -> None:
    c = llm.generate(["Hello world"], _params(JSON_SPEC, max_tokens=3))[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert c.text.startswith("{")


def test_an_invalid_spec_is_refused_naming_the_problem(llm: LLM) -> None:
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["Hi"], _params(StructuredOutputs("regex", "[a-")))
    with pytest.raises(ValueError, match="objectx"):
        llm.generate(["Hi"], _params(StructuredOutputs("json", '{"type": "objectx"}')))
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputs("yaml", "a: b")
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_sampler_masks_only_the_constrained_rows(path: str, monkeypatch) -> None:
    if path == "torch":  # the fallback where the C kernel cannot be built
        monkeypatch.setattr("tidal.layers.sampler.apply_token_bitmask_", lambda *a: False)
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
    mask[1] = 1 << 4  # only token 36
    mask[2] = 1 << 1  # and token 65
    greedy = SamplingParams(temperature=0)
    rows = [
        SamplingRow(greedy, [1], [], grammar_bitmask=None),
        SamplingRow(greedy, [1], [], grammar_bitmask=mask),
        SamplingRow(greedy, [1], []),
    ]
    out = Sampler(vocab, "cpu")(logits, rows).token_ids.tolist()
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[1] == (36 if logits[1, 36] > logits[1, 65] else 65)


def test_properties_a_schema_does_not_list_are_refused_unless_it_allows_them(llm: LLM) -> None:
    # As vLLM's default grammar engine: an object listing its properties takes no others unless
    # the schema says so; sampled outputs would otherwise invent keys.
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = StructuredOutputs("json", json.dumps(listed))
    params = SamplingParams(n=8, temperature=1.5, seed=3, max_tokens=40, structured_outputs=spec)
    for c in llm.generate(["Hello world"], params)[0].outputs:
        if c.finish_reason == "stop":
            assert set(json.loads(c.text)) == {"a"}, c.text
        else:
            assert re.fullmatch(r'\{"a": -?[0-9]*', c.text), c.text
    # Asked for: other keys may follow "a" (the same seeds write some).
    opened = StructuredOutputs("json", json.dumps({**listed, "additionalProperties": True}))
    outs = llm.generate(["Hello world"], dataclasses.replace(params, structured_outputs=opened))
    assert any(re.match(r'\{"a": -?[0-9]+, "', c.text) for c in outs[0].outputs)


def test_closed_schemas_leave_what_combines_or_allows_open() -> None:
    obj = {"properties": {"x": {"type": "integer"}}}
    shut = {**obj, "additionalProperties": False}
    assert closed(obj) == shut
    assert closed({**obj, "additionalProperties": True}) == {**obj, "additionalProperties": True}
    assert closed({**obj, "unevaluatedProperties": False}) == {
        **obj,
        "unevaluatedProperties": False,
    }
    # Nested objects, arrays, $defs and anyOf alternatives are closed; a property named
    # "properties" is a name, not a keyword.
    nested = {"properties": {"properties": obj, "list": {"items": obj}}, "$defs": {"D": obj}}
    assert closed(nested) == {
        "properties": {"properties": shut, "list": {"items": shut}},
        "$defs": {"D": shut},
        "additionalProperties": False,
    }
    assert closed({"anyOf": [obj, {"type": "null"}]}) == {"anyOf": [shut, {"type": "null"}]}
    # Properties spread over allOf members, a $ref, or an anyOf beside the object's own: open.
    spread = {"properties": {"y": {}}, "allOf": [obj], "anyOf": [obj]}
    assert closed(spread) == spread
    assert closed({"allOf": [obj]}) == {"allOf": [obj]}
    assert closed({**obj, "$ref": "#/$defs/D"}) == {**obj, "$ref": "#/$defs/D"}
    assert closed(True) is True and closed({"type": "object"}) == {"type": "object"}
