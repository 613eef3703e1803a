"""POST /v1/responses end to end: the tiny checkpoint's `tidal serve`, read with the openai SDK's
`client.responses` and checked against the SDK's own types. A response runs as the chat request
it maps to, so greedy answers must equal chat's for the same conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.engine.tiny import make_tiny_model_dir
from tests.server.conftest import API_KEY, KV_BYTES
from tests.server.tiny_server import ServerProcess, serve

MODEL = "tiny"
TOKENS = 8
EVENTS = TypeAdapter(ResponseStreamEvent)
TOOLS = [
    {
        "type": "function",
        "name": "w",
        "parameters": {
            "type": "object",
            "properties": {"c": {"type": "string", "maxLength": 4}},
            "required": ["c"],
        },
    }
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """With a key, on the tiny BPE model (its vocabulary has JSON's brackets, which tool calls
    need) with room for the tools' system text."""
    root = make_tiny_model_dir(tmp_path_factory.mktemp("tiny_responses"))
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    yield from serve(
        ["--model", str(root), "--kv-cache-bytes", KV_BYTES, "--api-key", API_KEY,
         "--served-model-name", MODEL, "--no-warmup"]
    )  # fmt: skip


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0, timeout=60
    )


def _post(server: ServerProcess, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(server.base_url + "/v1/responses", json=body, headers=headers, timeout=60)


def _chat_text(server: ServerProcess, messages: list[dict], **kw) -> tuple[str, object]:
    out = _client(server).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=TOKENS, **kw
    )
    return out.choices[0].message.content or "", out.usage


def test_a_response_is_the_chat_answer_in_the_responses_shape(server: ServerProcess) -> None:
    raw = _post(
        server,
        {"model": MODEL, "input": "Hi there", "instructions": "Be kind.", "temperature": 0,
         "max_output_tokens": TOKENS, "metadata": {"run": "1"}},
    )  # fmt: skip
    assert raw.status_code == 200, raw.text
    resp = Response.model_validate(raw.json())  # every field the SDK's type requires
    text, usage = _chat_text(
        server, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there"}]
    )
    assert resp.output_text == text
    assert resp.usage is not None and resp.usage.input_tokens == usage.prompt_tokens
    assert resp.usage.output_tokens == usage.completion_tokens == TOKENS
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.model, resp.object, resp.store, resp.metadata) == (
        MODEL,
        "response",
        False,
        {"run": "1"},
    )
    assert (resp.instructions, resp.max_output_tokens, resp.temperature) == (
        "Be kind.",
        TOKENS,
        0.0,
    )


def test_input_items_are_the_chat_conversation(server: ServerProcess) -> None:
    c = _client(server)
    call = {"city": "Paris"}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": json.dumps(call)},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    resp = c.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=TOKENS)
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    text, usage = _chat_text(server, messages)
    assert resp.output_text == text
    assert resp.usage.input_tokens == usage.prompt_tokens  # the same rendered prompt


def test_a_stream_sends_the_events_in_order_and_the_same_text(server: ServerProcess) -> None:
    body = {"model": MODEL, "input": "Once", "temperature": 0, "max_output_tokens": TOKENS}
    whole = Response.model_validate(_post(server, body).json())
    events = list(_client(server).responses.create(**body, stream=True))
    for e in events:  # each one is a valid event of the SDK's union, not just parsed leniently
        EVENTS.validate_python(e.model_dump())
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output[0].content[0].text == deltas
    assert final.usage.output_tokens == TOKENS and final.id == events[0].response.id


def test_a_stop_completes_and_the_stream_helper_returns_the_response(server: ServerProcess) -> None:
    body = {"model": MODEL, "input": "Hi", "temperature": 0, "max_output_tokens": 64}
    # the tiny model's greedy answer, cut at its second character
    first = _client(server).responses.create(**body).output_text
    stop = first[1]
    with _client(server).responses.stream(**body, extra_body={"stop": [stop]}) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == first[: first.index(stop)]


def test_function_calls_come_back_as_items(server: ServerProcess) -> None:
    c = _client(server)
    # one call: a random model would go on adding calls until max_output_tokens
    args = {"model": MODEL, "input": "Go", "tools": TOOLS, "max_output_tokens": 150,
            "parallel_tool_calls": False}  # fmt: skip
    resp = c.responses.create(**args, tool_choice="required")
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and calls[0].name == "w" and calls[0].call_id
    assert set(json.loads(calls[0].arguments)) == {"c"}
    events = list(
        c.responses.create(**args, stream=True, tool_choice={"type": "function", "name": "w"})
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas
    assert set(json.loads(deltas)) == {"c"}
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == deltas


def test_text_format_json_schema_is_enforced(server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    resp = _client(server).responses.create(
        model=MODEL, input="JSON please", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
    )  # fmt: skip
    assert json.loads(resp.output_text)["a"] in ("x", "y")
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # the template reads none
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 1, "tools": TOOLS}, "include"),  # tool text is not all output text
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),  # no turn at all
        ({"input": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ],
)  # fmt: skip
def test_what_tidal_cannot_honour_is_a_400_naming_the_field(
    server: ServerProcess, extra: dict, param: str
) -> None:
    raw = _post(server, {"model": MODEL, "input": "Hi", **extra})
    assert raw.status_code == 400, raw.text
    assert raw.json()["error"]["param"] == param


def test_the_route_has_the_other_routes_guards(server: ServerProcess) -> None:
    no_key = httpx.post(server.base_url + "/v1/responses", json={"input": "Hi"}, timeout=30)
    assert no_key.status_code == 401
    assert _post(server, {"model": "other", "input": "Hi"}).status_code == 404
    bad = httpx.post(
        server.base_url + "/v1/responses",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_retrieving_a_response_says_none_are_stored(server: ServerProcess) -> None:
    c = _client(server)
    resp = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert resp.store is False
    # the request log names the response by the id its client got
    server.wait_until(lambda: f"request {resp.id}-0: length" in server.log, "its log line", 30)
    for call in (c.responses.retrieve, c.responses.delete, c.responses.cancel):
        with pytest.raises(openai.NotFoundError, match="stores no responses"):
            call(resp.id)
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        c.responses.input_items.list(resp.id)
    assert httpx.get(server.base_url + f"/v1/responses/{resp.id}").status_code == 401  # no key


def test_output_text_logprobs_streamed_or_not(server: ServerProcess) -> None:
    c = _client(server)
    body = {"model": MODEL, "input": "Once", "temperature": 0, "max_output_tokens": TOKENS,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    whole = c.responses.create(**body)
    lps = whole.output[0].content[0].logprobs
    assert len(lps) == whole.usage.output_tokens == TOKENS
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob for t in lps)
    events = list(c.responses.create(**body, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lps]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [t.token for t in done.logprobs] == [t.token for t in lps]
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once"}], temperature=0,
        max_tokens=TOKENS, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert [t.logprob for t in chat.choices[0].logprobs.content] == [t.logprob for t in lps]
