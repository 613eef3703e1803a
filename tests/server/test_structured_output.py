"""Constrained output through the OpenAI API on a tiny server: response_format json_schema,
vLLM's structured_outputs / guided_* on chat and completions, streamed and not, and 400s naming
the field for bad or conflicting constraints.

Its own server: the shared tiny server's character vocabulary has no braces, so it cannot write
JSON; this one serves the engine tests' tiny model, whose byte-level BPE can write any text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.engine.tiny import make_tiny_model_dir
from tests.server.tiny_server import ServerProcess, serve
from tidal.server.errors import APIError
from tidal.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

MODEL = "tiny-bpe"
USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "kind": {"enum": ["a", "bb"]},
    },
    "required": ["name", "n", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bpe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-bpe"))
    # Room for the tools' system text, which the tiny BPE spends ~600 tokens on.
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    yield from serve(
        ["--model", str(model), "--kv-cache-bytes", str(4 << 20), "--served-model-name", MODEL]
    )


@pytest.fixture(scope="module")
def client(bpe_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{bpe_server.base_url}/v1", api_key="unused", timeout=60)


def test_chat_json_schema_validates_streamed_or_not(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=40, response_format=fmt
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=40, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content


def test_completions_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    def complete(max_tokens: int = 12, **extra: object) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL, prompt="Tide", temperature=0, max_tokens=max_tokens, extra_body=extra
        )

    out = complete(structured_outputs={"regex": r"[a-c]{2}[0-9]"}).choices[0]
    assert re.fullmatch(r"[a-c]{2}[0-9]", out.text) and out.finish_reason == "stop"
    out = complete(guided_choice=["left", "right"]).choices[0]
    assert out.text in ("left", "right")
    out = complete(guided_grammar='root ::= "x" [0-9] [0-9]').choices[0]
    assert re.fullmatch(r"x[0-9]{2}", out.text)
    out = client.completions.create(
        model=MODEL, prompt="Tide", n=2, temperature=1.0, seed=3, max_tokens=60,
        extra_body={"guided_json": SCHEMA},
    )  # fmt: skip
    for c in out.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "objectx"}}}}, "response_format", "objectx"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "'xml' is not supported"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "Only one output constraint"),
    ]  # fmt: skip
    for body, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=4, extra_body=body
            )
        assert e.value.body["param"] == param, e.value.body
        assert message in e.value.message
    # The server still serves after every refusal.
    ok = client.completions.create(model=MODEL, prompt="Tide", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_protocol_builds_one_spec_per_request() -> None:
    chat = parse_request(
        ChatCompletionRequest, {"messages": USER, "response_format": {"type": "json_object"}}
    )
    assert chat.to_sampling_params().structured_outputs.kind == "json_object"
    text = parse_request(
        ChatCompletionRequest, {"messages": USER, "response_format": {"type": "text"}}
    )
    assert text.to_sampling_params().structured_outputs is None
    comp = parse_request(CompletionRequest, {"prompt": "x", "guided_json": json.dumps(SCHEMA)})
    spec = comp.to_sampling_params().structured_outputs
    assert spec.kind == "json" and json.loads(spec.spec) == SCHEMA
    with pytest.raises(APIError):
        parse_request(CompletionRequest, {"prompt": "x", "guided_json": "{"}).to_sampling_params()


@pytest.mark.parametrize(
    ("extra", "param"), [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 3}, "min_tokens")]
)
def test_constraints_refuse_what_would_override_the_grammars_end(extra, param) -> None:
    """A constrained output ends where its grammar accepts; ignore_eos or min_tokens would be
    silently overruled, so they are a 400 naming the field (a forced tool call too)."""
    bodies = [
        (CompletionRequest, {"prompt": "x", "guided_regex": "[ab]+"}),
        (ChatCompletionRequest, {"messages": USER, "response_format": {"type": "json_object"}}),
        (ChatCompletionRequest, {"messages": USER, "tools": TOOLS, "tool_choice": "required"}),
    ]
    for cls, body in bodies:
        with pytest.raises(APIError) as e:
            parse_request(cls, {**body, **extra}).to_sampling_params()
        assert e.value.status == 400 and e.value.param == param
        assert "structured output constraint" in str(e.value)
        # Unconstrained, the same setting is honoured as before.
        plain = {k: v for k, v in body.items() if k in ("prompt", "messages")}
        assert (
            parse_request(cls, {**plain, **extra}).to_sampling_params().structured_outputs is None
        )


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _chat(client: openai.OpenAI, **kw: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=60, tools=TOOLS, **kw
    )


def test_named_and_required_tool_choice_always_parse(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _chat(client, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    one = _chat(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    for call in one.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_streamed_forced_tool_call_yields_valid_arguments(
    client: openai.OpenAI, tool_choice: str
) -> None:
    choice: object = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_time"}}
    calls: dict[int, dict] = {}
    finish = None
    # One call: the random model would add items until max_tokens (test_tool_parsers streams
    # several through the same scanner).
    for chunk in _chat(client, tool_choice=choice, stream=True, parallel_tool_calls=False):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        assert not c.delta.content
        indexes = [d.index for d in c.delta.tool_calls or []]
        assert len(indexes) == len(set(indexes)), indexes  # one entry per call in a chunk
        for d in c.delta.tool_calls or []:
            if d.id is not None:  # a call's first fragment: its id and name
                assert d.index not in calls
                calls[d.index] = {"id": d.id, "name": d.function.name, "args": ""}
            calls[d.index]["args"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    assert sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])
    if tool_choice == "named":
        assert [c["name"] for c in calls.values()] == ["get_time"]


def test_auto_tools_and_tool_turns_render(client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8
    )
    choice = resp.choices[0]  # the random model writes text, not a call
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content


def test_tokenize_counts_the_tokens_a_chat_request_sends(bpe_server: ServerProcess) -> None:
    # Tools, tool turns and a continued final message render as the chat endpoint renders them.
    url = bpe_server.base_url
    turns = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    continued = [*USER, {"role": "assistant", "content": "It is"}]
    cases = [
        {"messages": turns, "tools": TOOLS},
        {"messages": continued, "continue_final_message": True, "add_generation_prompt": False},
    ]
    counts = []
    for body in cases:
        chat = {**body, "model": MODEL, "max_tokens": 1}
        sent = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()["usage"]
        counted = httpx.post(f"{url}/tokenize", json=body, timeout=60).json()
        assert counted["count"] == sent["prompt_tokens"], body
        counts.append(counted["count"])
    plain = httpx.post(f"{url}/tokenize", json={"messages": turns}).json()
    assert plain["count"] < counts[0]  # the tools' system text
    bad = httpx.post(f"{url}/tokenize", json={"messages": USER, "tools": [{}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_bad_tool_requests_are_400s(client: openai.OpenAI) -> None:
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not in tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "tool 0 must be"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "Only one output constraint"),
    ]  # fmt: skip
    for body, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=4, extra_body=body
            )
        assert e.value.body["param"] == param, e.value.body
        assert message in e.value.message


def test_metrics_count_constrained_requests_and_mask_time(bpe_server: ServerProcess) -> None:
    import urllib.request

    # Runs after the tests above (file order): they sent json, regex, choice and grammar requests.
    with urllib.request.urlopen(f"{bpe_server.base_url}/metrics", timeout=30) as r:
        text = r.read().decode()

    def value(line_start: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(line_start))
        return float(line.rsplit(" ", 1)[1])

    assert value('tidal:structured_output_requests_total{kind="json"}') >= 2
    assert value('tidal:structured_output_requests_total{kind="regex"}') >= 1
    assert value("tidal:grammar_mask_seconds_count") > 0
    assert value("tidal:grammar_mask_seconds_sum") > 0
