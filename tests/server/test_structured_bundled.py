"""The bundled Gemma 3 270M over HTTP with the openai SDK: 10 JSON schemas validate, json_object
parses, regex and choice match, a streamed tool call with tool_choice required has valid
arguments (about 10 s of the real model on 2 CPU cores).

Numbers are integers with ranges and strings have maxLength: a greedy 270M base model inside a
free number or string can repeat a digit or a word until max_tokens ("0.00000..."), which says
nothing about the constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.tiny_server import serve

_S = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0,
     "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": _S, "country": _S, "population": {"type": "integer",
     "minimum": 0, "maximum": 40000000}}, "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": _S, "minItems": 1,
     "maxItems": 3}}, "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
     "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["sentiment",
     "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type":
     "integer", "minimum": 1, "maximum": 9999}, "email": _S}, "required": ["id"],
     "additionalProperties": False}, "active": {"type": "boolean"}}, "required": ["user", "active"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": _S, "tags": {"type": "array", "items": {"enum":
     ["news", "sport", "tech"]}, "maxItems": 2}, "year": {"type": "integer", "minimum": 1900,
     "maximum": 2100}}, "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"celsius": {"type": "integer", "minimum": -50, "maximum": 60},
     "unit": {"const": "C"}}, "required": ["celsius", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object",
     "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer",
     "minimum": 0, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": False},
     "minItems": 1, "maxItems": 2}}, "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": _S},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"product": _S, "price": {"type": "integer", "minimum": 0,
     "maximum": 1000}, "in_stock": {"type": "boolean"}, "sizes": {"type": "array", "items":
     {"enum": ["S", "M", "L"]}, "maxItems": 3}}, "required": ["product", "price", "in_stock"],
     "additionalProperties": False},
]  # fmt: skip
PROMPTS = [
    "Describe a person as JSON.",
    "Describe a city as JSON.",
    "List some colors as JSON.",
    "Rate the sentiment of 'I love this!' as JSON.",
    "Describe a user account as JSON.",
    "Describe a news article as JSON.",
    "Give today's temperature as JSON.",
    "Give a few points on a grid as JSON.",
    "Is the sky blue? Answer as JSON.",
    "Describe a shirt for sale as JSON.",
]


@pytest.fixture(scope="module")
def client():  # type: ignore[no-untyped-def]
    for srv in serve(["--kv-cache-bytes", str(64 << 20), "--max-model-len", "1024"]):
        yield openai.OpenAI(api_key="none", base_url=srv.base_url + "/v1", timeout=300)


def _chat(client: openai.OpenAI, content: str, **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **kw,
    )


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_output_validates(client: openai.OpenAI, i: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}
    choice = _chat(client, PROMPTS[i], response_format=fmt).choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    # A prompt the model closes under greedy with int8 and with float activations alike (the
    # former one, asking for a key "capital", opened nested objects until max_tokens under int8).
    ask = 'Give a JSON object with one key "answer" whose value is the capital of France.'
    choice = _chat(client, ask, response_format={"type": "json_object"}).choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    out = _chat(client, "What date is it?", extra_body={"structured_outputs": {"regex": date}})
    assert re.fullmatch(date, out.choices[0].message.content)
    out = _chat(client, "Is fire hot?", extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no")


def test_streamed_required_tool_call_has_valid_arguments(client: openai.OpenAI) -> None:
    params = {"type": "object", "properties": {"city": _S, "unit": {"enum": ["C", "F"]}},
              "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description":
              "Current weather in a city", "parameters": params}}]  # fmt: skip
    stream = _chat(client, "What is the weather in Paris?", tools=tools, tool_choice="required",
                   stream=True, parallel_tool_calls=False)  # fmt: skip
    name, args, finish = None, "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name = d.function.name or name
            args += d.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(json.loads(args), params)
