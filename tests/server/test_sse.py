"""SSE framing: one compact JSON object per data line, the [DONE] sentinel, error events, comments."""

from __future__ import annotations

import json

from tidal.server.errors import deadline_exceeded
from tidal.server.responses import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from tidal.server.sse import SSE_DONE, sse_comment, sse_error_event, sse_event


def test_mapping_is_compact_json_on_one_data_line() -> None:
    event = sse_event({"text": "a\nb\r\nc", "n": [1, 2], "u": "é"})
    assert event == 'data: {"text":"a\\nb\\r\\nc","n":[1,2],"u":"é"}\n\n'.encode()
    assert event.count(b"\n") == 2  # newlines inside strings are escaped, never raw


def test_pydantic_chunk_matches_openai_shape() -> None:
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=7, model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="Hi"))],
    )  # fmt: skip
    event = sse_event(chunk)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[len(b"data: ") :]) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
        ],
        "usage": None,
    }


def test_done_error_and_comment_frames() -> None:
    assert SSE_DONE == b"data: [DONE]\n\n"
    err = sse_error_event(deadline_exceeded(2.5))
    assert err == (
        b'data: {"error":{"message":"The request did not finish within its deadline of 2.5 s.",'
        b'"type":"timeout_error","param":null,"code":"deadline_exceeded"}}\n\n'
    )
    assert sse_comment("keep\nalive") == b": keep alive\n\n"
