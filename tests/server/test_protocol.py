"""Protocol models against the real `openai` SDK: the JSON it sends parses, what we send back it reads.

The SDK talks to an in-process httpx transport (no sockets, no network): the handler captures the
exact request body the SDK produced and answers with our response models and SSE frames.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx2 as httpx  # the openai SDK installed here is built on httpx2
import openai
import pytest

from tidal.sampling_params import SamplingParams
from tidal.server.errors import APIError, from_validation_error, invalid_api_key, queue_full
from tidal.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from tidal.server.protocol_tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_tokenize_request,
)
from tidal.server.responses import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
)
from tidal.server.sse import SSE_DONE, sse_error_event, sse_event

Handler = Callable[[httpx.Request], httpx.Response]


def _client(handler: Handler) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.MockTransport(handler))
    return openai.OpenAI(
        api_key="sk-test", base_url="http://tidal.test/v1", http_client=http, max_retries=0
    )


def _json(model: object) -> httpx.Response:
    return httpx.Response(
        200, content=model.model_dump_json(), headers={"content-type": "application/json"}
    )  # type: ignore[attr-defined]


def _sse(*frames: bytes) -> httpx.Response:
    return httpx.Response(
        200, content=b"".join(frames), headers={"content-type": "text/event-stream"}
    )


def test_sdk_streaming_chat_request_parses_and_chunks_read_back() -> None:
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        head = {"id": "chatcmpl-1", "created": 1, "model": "gemma"}
        lp = ChatChoiceLogprobs(content=[ChatTokenLogprob(token="Hi", logprob=-0.25, bytes=[72, 105],
                                                          top_logprobs=[TopLogprob(token="Hi", logprob=-0.25, bytes=[72, 105])])])  # fmt: skip
        return _sse(
            sse_event(ChatCompletionStreamResponse(**head, choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])),
            sse_event(ChatCompletionStreamResponse(**head, choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="Hi"), logprobs=lp)])),
            sse_event(ChatCompletionStreamResponse(**head, choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="length")])),
            sse_event(ChatCompletionStreamResponse(**head, choices=[], usage=UsageInfo.of(9, 1, cached_tokens=8))),
            SSE_DONE,
        )  # fmt: skip

    stream = _client(handler).chat.completions.create(
        model="gemma",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}],
            },
        ],
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=1,
        temperature=0.0,
        top_p=0.9,
        seed=7,
        stop=["\n"],
        logprobs=True,
        top_logprobs=1,
        presence_penalty=0.1,
        frequency_penalty=0.5,
        logit_bias={"50256": -100},
        user="u-1",
        store=False,  # a field we ignore
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "priority": 2,
            "timeout_s": 3.5,
            "session_id": "s-1",
        },
    )
    chunks = list(stream)
    assert [c.choices[0].delta.content if c.choices else None for c in chunks] == [
        "",
        "Hi",
        None,
        None,
    ]
    assert chunks[1].choices[0].logprobs.content[0].bytes == [72, 105]  # type: ignore[union-attr]
    assert chunks[2].choices[0].finish_reason == "length"
    assert chunks[3].usage is not None and chunks[3].usage.total_tokens == 10
    assert chunks[3].usage.prompt_tokens_details.cached_tokens == 8  # type: ignore[union-attr]

    body = json.loads(seen[0])
    assert body["stream_options"] == {"include_usage": True} and body["store"] is False
    req = parse_request(ChatCompletionRequest, seen[0])
    assert req.include_usage and req.stream
    assert [m.text() for m in req.messages] == ["Be brief.", "Say hi"]
    assert (req.priority, req.timeout_s, req.session_id) == (2, 3.5, "s-1")
    assert req.to_sampling_params() == SamplingParams(
        temperature=0.0, top_p=0.9, top_k=20, min_p=0.05, seed=7, stop=["\n"], max_tokens=1,
        logprobs=1, presence_penalty=0.1, frequency_penalty=0.5, logit_bias={50256: -100.0},
    )  # fmt: skip


def test_sdk_completion_with_token_ids_echo_and_logprobs() -> None:
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        lp = CompletionLogProbs(text_offset=[0, 2], token_logprobs=[None, float("-inf")], tokens=["He", "llo"],
                                top_logprobs=[None, {"llo": float("-inf"), "y": -1.5}])  # fmt: skip
        choice = CompletionChoice(index=0, text="Hello", logprobs=lp, finish_reason="stop")
        return _json(
            CompletionResponse(
                id="cmpl-1", created=1, model="gemma", choices=[choice], usage=UsageInfo.of(1, 1)
            )
        )

    out = _client(handler).completions.create(model="gemma", prompt=[[10, 11], [12]], echo=True, logprobs=2, max_tokens=4,
                                              stop="\n\n", n=1, best_of=1, extra_body={"ignore_eos": True, "min_tokens": 2})  # fmt: skip
    assert out.object == "text_completion" and out.choices[0].finish_reason == "stop"
    assert out.choices[0].logprobs.token_logprobs == [None, -9999.0]  # type: ignore[union-attr]  # -inf is not JSON
    assert out.choices[0].logprobs.top_logprobs[1] == {"llo": -9999.0, "y": -1.5}  # type: ignore[union-attr,index]
    req = parse_request(CompletionRequest, seen[0])
    assert req.prompts() == [[10, 11], [12]]
    assert req.to_sampling_params() == SamplingParams(
        max_tokens=4, stop=["\n\n"], logprobs=2, prompt_logprobs=2, ignore_eos=True, min_tokens=2
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_shapes(prompt: object, expected: object) -> None:
    assert parse_request(CompletionRequest, {"prompt": prompt}).prompts() == expected


def test_defaults_and_nulls() -> None:
    # OpenAI's legacy default is 16 tokens; an explicit null (the SDK's None) runs to the context limit.
    assert parse_request(CompletionRequest, {"prompt": "x"}).to_sampling_params() == SamplingParams(
        max_tokens=16
    )
    nulls = {
        "prompt": "x",
        "max_tokens": None,
        "temperature": None,
        "n": None,
        "stop": None,
        "stream": None,
        "logprobs": None,
    }
    assert parse_request(CompletionRequest, nulls).to_sampling_params() == SamplingParams(
        max_tokens=None
    )
    chat = parse_request(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    )
    assert chat.to_sampling_params() == SamplingParams(max_tokens=8)
    assert (
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})
        .to_sampling_params()
        .max_tokens
        is None
    )
    assistant_null = {
        "messages": [
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    }
    assert [m.text() for m in parse_request(ChatCompletionRequest, assistant_null).messages] == [
        "",
        "42",
    ]


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("cls", "body", "param", "message"),
    [
        (ChatCompletionRequest, {"messages": USER, "temperature": "hot"}, "temperature", "Input should be a valid number (got 'hot')"),
        (ChatCompletionRequest, {"messages": USER, "max_tokens": True}, "max_tokens", "valid integer"),
        (ChatCompletionRequest, {"messages": USER, "stream": 1}, "stream", "valid boolean"),
        (ChatCompletionRequest, {"messages": []}, "messages", "at least one message"),
        (ChatCompletionRequest, {}, "messages", "Missing required parameter: 'messages'."),
        (ChatCompletionRequest, {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'bot' is not a role"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages[0].content", "null only in assistant"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
         "messages[0].content", "part 0 has type 'image_url'"),
        (ChatCompletionRequest, {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
        (ChatCompletionRequest, {"messages": USER, "top_logprobs": 3}, "top_logprobs", "needs logprobs set to true"),
        (ChatCompletionRequest, {"messages": USER, "tools": [{"type": "function"}]}, "tools", "tool 0 must be"),
        (ChatCompletionRequest, {"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias", "token id"),
        (ChatCompletionRequest, {"messages": USER, "timeout_s": 0}, "timeout_s", "positive number of seconds"),
        (ChatCompletionRequest, {"messages": USER, "modalities": ["text", "audio"]}, "modalities", "only ['text'] is served"),
        (ChatCompletionRequest, {"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported (tidal writes text only)"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt", "must be a string, a list of strings"),
        (CompletionRequest, {"prompt": []}, "prompt", "non-empty"),
        (CompletionRequest, {"prompt": [-1]}, "prompt", "token ids >= 0"),
        (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        (CompletionRequest, {"prompt": "x", "use_beam_search": True}, "use_beam_search", "not supported (tidal does not run beam search"),
        (CompletionRequest, {"prompt": "x", "allowed_token_ids": [1]}, "allowed_token_ids", "not supported"),
        (CompletionRequest, {"prompt": "x", "cache_salt": "a"}, "cache_salt", "shared by every request"),
        (CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "must be -1"),
        (ChatCompletionRequest, {"messages": USER, "echo": True}, "echo", "new message only"),
        (ChatCompletionRequest, {"messages": USER, "functions": [{"name": "f"}]}, "functions", "send tools"),
        (ChatCompletionRequest, {"messages": USER, "web_search_options": {}}, "web_search_options", "tidal searches nothing"),
        (ChatCompletionRequest, {"messages": USER, "store": True}, "store", "stores no completions"),
        (ChatCompletionRequest, {"messages": USER, "verbosity": "low"}, "verbosity", "max_completion_tokens"),
        (ChatCompletionRequest, {"messages": USER, "service_tier": "flex"}, "service_tier", "send priority"),
        (ChatCompletionRequest, {"messages": USER, "service_tier": []}, "service_tier", "send priority"),
        (CompletionRequest, {"prompt": "x", "n": 2, "best_of": 3}, "best_of", "unless it equals n"),
        (CompletionRequest, {"prompt": "x", "stop_token_ids": [1, -2]}, "stop_token_ids", "token ids >= 0"),
        (CompletionRequest, {"prompt": "x", "stop": ["s"] * 65}, "stop", "at most 64 stop strings of at most 1024"),
        (ChatCompletionRequest, {"messages": USER, "stop": "s" * 1025}, "stop", "at most 64 stop strings"),
    ],
)  # fmt: skip
def test_parse_errors_name_the_param(
    cls: type, body: dict[str, object], param: str, message: str
) -> None:
    with pytest.raises(APIError) as info:
        parse_request(cls, body)
    err = info.value
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert message in err.message


def test_unserved_fields_at_their_defaults_are_accepted() -> None:
    # What vLLM's clients send when they ask for nothing (defaults written out) still parses.
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "echo": False}
    req = parse_request(ChatCompletionRequest, {"messages": USER, **defaults, "audio": None})
    assert req.to_sampling_params().n == 1
    parse_request(
        CompletionRequest, {"prompt": "x", "length_penalty": 1, "return_token_ids": False}
    )
    # OpenAI's defaults written out: no store, medium verbosity, the auto or default tier
    openai_defaults = {"store": False, "verbosity": "medium", "service_tier": "auto"}
    parse_request(ChatCompletionRequest, {"messages": USER, **openai_defaults})
    parse_request(ChatCompletionRequest, {"messages": USER, "service_tier": "default"})


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": USER, "top_p": 1.5}, "top_p", "top_p=1.5 is invalid: expected a number in (0, 1]"),
        ({"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens", "max_completion_tokens=-1 is invalid"),
        ({"messages": USER, "max_tokens": -1}, "max_tokens", "max_tokens=-1 is invalid"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs=21 is invalid: expected an integer in [0, 20]"),
        ({"messages": USER, "presence_penalty": 3.0}, "presence_penalty", "in [-2, 2]"),
        ({"messages": USER, "n": 0}, "n", "n=0 is invalid"),
        ({"messages": USER, "n": 100000}, "n", "n=100000 is invalid: expected an integer in [1, 128]"),
        ({"messages": USER, "max_tokens": 2, "min_tokens": 3}, "min_tokens", "at most max_tokens (2)"),
        ({"messages": USER, "prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs=21 is invalid"),
    ],
)  # fmt: skip
def test_sampling_errors_name_the_request_param(
    body: dict[str, object], param: str, message: str
) -> None:
    req = parse_request(ChatCompletionRequest, body)
    with pytest.raises(APIError) as info:
        req.to_sampling_params()
    assert (info.value.status, info.value.param) == (400, param)
    assert message in info.value.message


def test_bad_json_and_non_object_bodies() -> None:
    with pytest.raises(APIError, match="not valid JSON") as info:
        parse_request(ChatCompletionRequest, b'{"messages": [')
    assert info.value.code == "invalid_json"
    with pytest.raises(APIError, match="must be a JSON object"):
        parse_request(CompletionRequest, b"[1, 2]")


def test_from_validation_error_uses_the_first_error() -> None:
    try:
        ChatCompletionRequest.model_validate({"messages": USER, "temperature": "a", "top_p": "b"})
    except Exception as e:  # pydantic.ValidationError
        err = from_validation_error(e)  # type: ignore[arg-type]
    assert err.param == "temperature"


def test_sdk_raises_the_matching_exception_for_error_bodies() -> None:
    def answer(err: APIError) -> Handler:
        return lambda request: httpx.Response(
            err.status,
            content=err.body(),
            headers={"content-type": "application/json", **err.headers},
        )

    with pytest.raises(openai.BadRequestError) as bad:
        _client(answer(_parse_error({"messages": USER, "top_p": 2}))).chat.completions.create(
            model="m", messages=USER
        )  # type: ignore[arg-type]
    assert (bad.value.param, bad.value.code) == ("top_p", "invalid_value")
    with pytest.raises(openai.AuthenticationError) as auth:
        _client(answer(invalid_api_key())).models.list()
    assert auth.value.code == "invalid_api_key"
    full = queue_full(max_queue=4, retry_after_s=0.2)
    assert full.headers == {"Retry-After": "1"}
    with pytest.raises(openai.RateLimitError):
        _client(answer(full)).completions.create(model="m", prompt="x")


def _parse_error(body: dict[str, object]) -> APIError:
    try:
        parse_request(ChatCompletionRequest, body).to_sampling_params()
    except APIError as e:
        return e
    raise AssertionError("expected an APIError")


def test_sdk_raises_on_an_in_stream_error_event() -> None:
    head = {"id": "c", "created": 1, "model": "m"}
    first = ChatCompletionStreamResponse(
        **head, choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="a"))]
    )
    err = APIError(500, "engine died", "server_error", None, "internal_error")
    stream = _client(
        lambda r: _sse(sse_event(first), sse_error_event(err), SSE_DONE)
    ).chat.completions.create(
        model="m",
        messages=USER,
        stream=True,  # type: ignore[arg-type]
    )
    it = iter(stream)
    assert next(it).choices[0].delta.content == "a"
    with pytest.raises(openai.APIError, match="engine died"):
        next(it)


def test_sdk_reads_chat_response_and_model_list() -> None:
    chat = ChatCompletionResponse(model="gemma", choices=[ChatCompletionChoice(index=0, message=ChatResponseMessage(content="yo"), finish_reason="stop")],
                                  usage=UsageInfo.of(3, 1))  # fmt: skip
    out = _client(lambda r: _json(chat)).chat.completions.create(model="gemma", messages=USER)  # type: ignore[arg-type]
    assert (out.object, out.choices[0].message.role, out.choices[0].message.content) == (
        "chat.completion",
        "assistant",
        "yo",
    )
    assert out.id.startswith("chatcmpl-") and out.usage is not None and out.usage.total_tokens == 4
    models = ModelList(
        data=[ModelCard(id="gemma", created=5, root="/m/gemma.gguf", max_model_len=2048)]
    )
    listed = _client(lambda r: _json(models)).models.list()
    assert [(m.id, m.object, m.owned_by, m.created) for m in listed.data] == [
        ("gemma", "model", "tidal", 5)
    ]


def test_tokenize_and_detokenize_bodies() -> None:
    plain = parse_tokenize_request(b'{"model": "m", "prompt": "hello"}')
    assert isinstance(plain, TokenizeCompletionRequest) and plain.add_special_tokens is True
    chat = parse_tokenize_request({"messages": USER})
    assert (
        isinstance(chat, TokenizeChatRequest)
        and chat.add_special_tokens is False
        and chat.add_generation_prompt is True
    )
    assert parse_request(DetokenizeRequest, {"tokens": [1, 2]}).tokens == [1, 2]
    with pytest.raises(APIError) as info:
        parse_tokenize_request(b'{"prompt": 5}')
    assert info.value.param == "prompt"
    with pytest.raises(APIError) as info:
        parse_request(DetokenizeRequest, {"tokens": [1, -1]})
    assert info.value.param == "tokens"


def test_fields_tidal_does_not_read_are_logged_once_by_name(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tidal.server.ignored as ignored
    from tidal.server.protocol_responses import PASSED_ON, ResponsesRequest

    monkeypatch.setattr(ignored, "_REPORTED", set())
    body = {"messages": USER, "prediction": {"type": "content"}, "top_a": 0.2}
    with caplog.at_level("WARNING", logger="tidal.server.ignored"):
        parse_request(ChatCompletionRequest, body)
        parse_request(ChatCompletionRequest, body)  # the same names again: not repeated
        # a Responses body's chat fields are read (passed on), not ignored
        parse_request(ResponsesRequest, {"input": "x", "top_k": 5, "stop": ["."]}, PASSED_ON)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "ChatCompletionRequest" in lines[0] and "'prediction', 'top_a'" in lines[0]
    # bounded: a client inventing names cannot grow the log or the set without end
    monkeypatch.setattr(ignored, "MAX_REPORTED", 3)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tidal.server.ignored"):
        for k in range(10):
            parse_request(CompletionRequest, {"prompt": "x", f"junk{k}": 1})
    assert len(ignored._REPORTED) == 3 and len(caplog.records) == 1
    assert "no further ones are reported" in caplog.records[0].getMessage()
