"""Server-sent events framing for streamed completions: one compact JSON object per `data:` line.

A stream is `sse_event(chunk)`... then `SSE_DONE`. A failure mid-stream (after the 200 status is
sent) is `sse_error_event(err)` followed by `SSE_DONE`; the `openai` SDK raises `APIError` on a
data object holding an "error" key, which is also what vLLM sends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from pydantic import BaseModel

from tidal.server.errors import APIError

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
SSE_MEDIA_TYPE = "text/event-stream"


def sse_event(obj: BaseModel | Mapping[str, object] | Sequence[object]) -> bytes:
    """`data: <compact json>\\n\\n`. JSON escapes CR and LF inside strings, so one line is safe."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json()  # pydantic's JSON is already compact
    else:
        payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return b"data: " + payload.encode() + b"\n\n"


def sse_error_event(err: APIError) -> bytes:
    """The in-stream form of an error: `data: {"error": {...}}\\n\\n` (send SSE_DONE after it)."""
    return b"data: " + err.body() + b"\n\n"


def sse_comment(text: str = "") -> bytes:
    """`: text\\n\\n`, ignored by clients; a keep-alive while a request waits in the queue."""
    return b": " + text.replace("\n", " ").replace("\r", " ").encode() + b"\n\n"
