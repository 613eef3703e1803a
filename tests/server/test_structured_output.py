"""Constrained output through the OpenAI API on a tiny server: response_format json_schema,
vLLM's structured_outputs / guided_* on chat and completions, streamed and not, and 400s naming
the field for bad or conflicting constraints.

Its own server: the shared tiny server's character vocabulary has no braces, so it cannot write
JSON; this one serves the engine tests' tiny model, whose byte-level BPE can write any text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

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
