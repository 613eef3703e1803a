"""POST /v1/responses: OpenAI's Responses API over the chat path (server/protocol_responses.py).

A finished chat answer becomes the response's output items: a `reasoning` item (a reasoning
model's thought, from the reasoning parser), a `message` with one `output_text`, and one
`function_call` item per tool call. Streamed, the chat chunks become the Responses events in
OpenAI's order (response.created, response.in_progress, then per item output_item.added,
content_part.added, the deltas, their done events and output_item.done, and response.completed,
or response.incomplete when max_output_tokens cut it), each with its sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tidal.config.cache import CacheConfig
from tidal.server.errors import APIError, bad_request
from tidal.server.guards import admit, check_auth, state_of
from tidal.server.protocol import decode_json, parse_request
from tidal.server.protocol_responses import PASSED_ON, ResponsesRequest, chat_request, renamed
from tidal.server.responses import (
    ChatChoiceLogprobs,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    UsageInfo,
)
from tidal.server.routes_chat import ChatRun, start_chat
from tidal.server.sse import SSE_HEADERS, SSE_MEDIA_TYPE


@dataclass(slots=True)
class _Parsed:
    req: ResponsesRequest
    body: dict[str, Any]

    @property
    def model(self) -> str | None:  # what admit checks against the served name
        return self.req.model


def _parse(raw: bytes) -> _Parsed:
    body = decode_json(raw)
    req = parse_request(ResponsesRequest, body, PASSED_ON)  # chat's fields: read, not ignored
    return _Parsed(req, body if isinstance(body, dict) else {})


async def create_response(request: Request) -> Response:
    state, parsed = await admit(request, _parse)
    req = parsed.req
    chat = chat_request(req, parsed.body, bool(req.stream))
    shape_id = _id("resp")
    try:
        run = await start_chat(state, chat, shape_id)
    except APIError as e:
        raise renamed(e) from None
    if req.wants_logprobs and (run.reasoning is not None or run.mode.kind != "none"):
        raise bad_request(
            "logprobs on /v1/responses come on the output text alone: with tools or a "
            "reasoning model the tokens are not all text (chat completions give every token's)",
            "include",
        )
    shape = _Shape(req, run, state.served_name, id=shape_id)
    if req.stream:
        body = await run.stream(shape.events)
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    out = await run.response(request)
    choice = out.choices[0]
    lps = _logprobs(choice.logprobs) if req.wants_logprobs else []
    items = _items(choice.message, choice.finish_reason, lps)
    body = shape.response(_status(choice.finish_reason), items, out.usage)
    return Response(_dumps(body), media_type="application/json")


async def stored_response(request: Request) -> Response:
    """GET/DELETE /v1/responses/{id}, its cancel and input_items: 404 that says why (after the
    key check, as every /v1 route): tidal keeps no responses."""
    check_auth(request, state_of(request))
    raise APIError(
        404,
        f"No response {request.path_params['response_id']!r}: tidal stores no responses (store "
        "is answered false); keep the output you received and send the whole conversation.",
        "invalid_request_error",
        "response_id",
        "not_found",
    )


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(lp: ChatChoiceLogprobs | None) -> list[dict[str, Any]]:
    """Chat's token logprobs as the output text's (the same fields: token, logprob, bytes,
    top_logprobs)."""
    return [t.model_dump() for t in lp.content] if lp is not None and lp.content else []


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _item(kind: str, status: str, content: list | None = None) -> dict[str, Any]:
    """A message or reasoning output item: the one shape a whole reply and a stream build."""
    item: dict[str, Any] = {"type": kind, "id": _id("msg" if kind == "message" else "rs"),
                            "status": status, "content": content or []}  # fmt: skip
    if kind == "message":
        item["role"] = "assistant"
    else:
        item["summary"] = []
    return item


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _items(
    message: ChatResponseMessage, finish: str | None, logprobs: list | None = None
) -> list[dict[str, Any]]:
    """A finished chat message as output items: reasoning, message, function calls."""
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(_item("reasoning", "completed", [_reasoning_part(message.reasoning_content)]))
    calls = message.tool_calls or []
    if message.content or not (calls or items):
        part = _text_part(message.content or "", logprobs)
        items.append(_item("message", _status(finish), [part]))
    for call in calls:
        fn = call.function
        items.append(_call_item(call.id, fn.name, fn.arguments, "completed"))
    return items


def _usage(usage: UsageInfo | None, cache: CacheConfig) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    # The prefix cache keeps the prompt's full blocks: those not read from it were written.
    written = 0
    if cache.enable_prefix_caching:
        written = max(0, usage.prompt_tokens // cache.block_size * cache.block_size - cached)
    details = usage.completion_tokens_details
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details else 0},
        "total_tokens": usage.total_tokens,
    }


@dataclass
class _Shape:
    """What a response says about its request, and the stream's event state."""

    req: ResponsesRequest
    run: ChatRun
    model: str
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0

    def response(
        self, status: str, output: list[dict[str, Any]], usage: UsageInfo | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        req, params = self.req, self.run.job.params
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True
            if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "background": False,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "truncation": req.truncation or "disabled",
            "usage": _usage(usage, self.run.job.state.config.engine.cache),
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {_dumps(payload)}\n\n".encode()

    async def events(
        self, chunks: AsyncIterator[ChatCompletionStreamResponse]
    ) -> AsyncIterator[bytes]:
        """The Responses events of a streamed chat answer. A client that leaves closes this
        body and, at once, the chunks, which abort the engine request (as chat's _chat_sse)."""
        try:
            async for b in self._events(chunks):
                yield b
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    async def _events(
        self, chunks: AsyncIterator[ChatCompletionStreamResponse]
    ) -> AsyncIterator[bytes]:
        stream = _ItemStream(self)
        yield self._event("response.created", response=self.response("in_progress", []))
        yield self._event("response.in_progress", response=self.response("in_progress", []))
        finish: str | None = None
        usage: UsageInfo | None = None
        try:
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    d = choice.delta
                    if d.reasoning_content:
                        for b in stream.text("reasoning", d.reasoning_content):
                            yield b
                    lps = _logprobs(choice.logprobs)
                    if d.content or lps:
                        for b in stream.text("message", d.content or "", lps):
                            yield b
                    for call in d.tool_calls or []:
                        for b in stream.call(call):
                            yield b
                    finish = choice.finish_reason or finish
        except APIError as e:
            yield self._event("error", code=e.code, message=e.message, param=e.param)
            error = {"code": e.code or "server_error", "message": e.message}
            response = self.response("failed", stream.output, usage, error=error)
            yield self._event("response.failed", response=response)
            return
        for b in stream.close(_status(finish)):
            yield b
        if not stream.output:  # nothing written: one empty message, as the whole response has
            for b in stream.text("message", "") + stream.close(_status(finish)):
                yield b
        status = _status(finish)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(kind, response=self.response(status, stream.output, usage))


@dataclass
class _ItemStream:
    """The output items of a stream: at most one open at a time, finished ones in `output`."""

    shape: _Shape
    output: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the item being written
    text_so_far: list[str] = field(default_factory=list)
    call_index: int | None = None  # the open function_call's chat tool-call index
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # the open message's tokens'
    # Tokens whose text is held back (a stop string may follow): their logprobs go with the next
    # text delta, or with the done events
    held: list[dict[str, Any]] = field(default_factory=list)

    def _begin(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text_so_far, self.logprobs = item, [], []
        index = len(self.output)
        out = [self.shape._event("response.output_item.added", output_index=index, item=item)]
        part = {"message": _text_part(""), "reasoning": _reasoning_part("")}.get(item["type"])
        if part is not None:
            out.append(
                self.shape._event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=part)
            )  # fmt: skip
        return out

    def text(self, kind: str, delta: str, logprobs: list | None = None) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close("completed")
            out += self._begin(_item(kind, "in_progress"))
        assert self.open is not None
        self.held += logprobs or []
        if not delta:
            return out
        self.text_so_far.append(delta)
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {}
        if kind == "message":
            extra["logprobs"], self.held = self.held, []
            self.logprobs += extra["logprobs"]
        out.append(
            self.shape._event(name, item_id=self.open["id"], output_index=len(self.output),
                              content_index=0, delta=delta, **extra)
        )  # fmt: skip
        return out

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = delta.get("index", 0)
        fn = delta.get("function") or {}
        if self.open is None or self.open["type"] != "function_call" or self.call_index != index:
            out += self.close("completed")
            self.call_index = index
            call_id = delta.get("id") or _id("call")
            out += self._begin(_call_item(call_id, fn.get("name") or "", "", "in_progress"))
        assert self.open is not None
        if fn.get("arguments"):
            self.text_so_far.append(fn["arguments"])
            out.append(
                self.shape._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.output), delta=fn["arguments"])
            )  # fmt: skip
        return out

    def close(self, status: str) -> list[bytes]:
        """Finish the open item: its done events, then it joins `output`."""
        item = self.open
        if item is None:
            return []
        self.open = None
        text, index, ev = "".join(self.text_so_far), len(self.output), self.shape._event
        out: list[bytes] = []
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            item.update(arguments=text, status="completed")
            out.append(ev("response.function_call_arguments.done", **ids, name=item["name"],
                          arguments=text))  # fmt: skip
        else:
            message = item["type"] == "message"
            if message:
                self.logprobs += self.held
                self.held = []
            part = _text_part(text, self.logprobs) if message else _reasoning_part(text)
            item.update(content=[part], status=status if message else "completed")
            if message:
                out.append(ev("response.output_text.done", **ids, content_index=0, text=text,
                              logprobs=self.logprobs))  # fmt: skip
            else:
                out.append(ev("response.reasoning_text.done", **ids, content_index=0, text=text))
            out.append(ev("response.content_part.done", **ids, content_index=0, part=part))
        out.append(ev("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out
