"""POST /v1/chat/completions: chat-templated generation, streamed as SSE deltas or returned as one JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tidal.server.errors import APIError
from tidal.server.generation import (
    ChoiceState,
    GenerationJob,
    UsageCounter,
    collect,
    effective_timeout_s,
    finish_error,
    open_stream,
    until_disconnect,
)
from tidal.server.guards import admit
from tidal.server.inputs import chat_input, check_logit_bias, check_max_tokens, check_request_size
from tidal.server.logprobs import chat_logprobs
from tidal.server.protocol import ChatCompletionRequest, parse_request
from tidal.server.reasoning import ChatReasoning, ReasoningSplitter
from tidal.server.responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatToolCall,
    DeltaMessage,
    FunctionCall,
    PromptLogprobs,
    UsageInfo,
    prompt_logprobs_json,
    random_id,
)
from tidal.server.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_error_event, sse_event
from tidal.server.state import ServerState
from tidal.server.tool_parsers import ToolParser, parser_for
from tidal.server.tools import ToolMode, ToolStream, read_calls


async def create_chat_completion(request: Request) -> Response:
    state, req = await admit(request, partial(parse_request, ChatCompletionRequest))
    run = await start_chat(state, req)
    if req.stream:
        # Errors before any output (429, 400) raise here and keep their status.
        body = await run.stream(_chat_sse)
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    body = await run.response(request)
    return Response(body.model_dump_json(), media_type="application/json")


async def _chat_sse(chunks: AsyncIterator[ChatCompletionStreamResponse]) -> AsyncIterator[bytes]:
    # A client that leaves closes this body and, at once, the chunks, which abort the engine
    # request (not whenever the garbage collector gets to them).
    try:
        async for c in chunks:
            yield sse_event(c)
        yield SSE_DONE
    except APIError as e:
        yield sse_error_event(e)
        yield SSE_DONE
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def start_chat(
    state: ServerState, req: ChatCompletionRequest, request_id: str | None = None
) -> ChatRun:
    """Everything up to generation: sampling params, the rendered and checked prompt, the job.
    Raises the request's 400s; /v1/responses runs its requests through here too (with its own
    id, which the request log then shows)."""
    params = req.to_sampling_params(state.sampling_defaults)
    mode = req.tool_mode()
    parser = parser_for(state.config.server.tool_call_parser, state.tokenizer.family)
    if mode.kind == "auto" and parser.start in _special_texts(state.tokenizer):
        params.skip_special_tokens = False  # the call's markers are special tokens
    # Off the event loop: a long conversation's encoding (the tokenizer's C code lets go of the
    # GIL) would hold every other stream for as long.
    inp = await asyncio.to_thread(chat_input, req, state.tokenizer, state.limits, mode)
    check_logit_bias(params, state.limits)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_max_tokens(params, len(inp.token_ids), state.limits, param)
    check_request_size(params, [len(inp.token_ids)], state.limits, state.config.server, param)
    # OpenAI's prompt_cache_key asks for what session_id gives: the conversation kept cached
    key = req.prompt_cache_key
    session = req.session_id or (key[:256] if key else None)
    job = GenerationJob(
        state,
        request_id or random_id("chatcmpl"),
        [inp],
        params,
        priority=req.priority or 0,
        session_id=session,
        timeout_s=effective_timeout_s(req.timeout_s, state.config.server.request_timeout_s),
        queue_timeout_s=effective_timeout_s(
            req.queue_timeout_s, state.config.server.queue_timeout_s
        ),
    )
    reasoning = ChatReasoning.of(state.reasoning, req, state.tokenizer)
    return ChatRun(req, job, params.logprobs, reasoning, mode, parser)


@dataclass(slots=True)
class ChatRun:
    """A chat request ready to generate: read it whole (`response`) or as chunks (`stream`)."""

    req: ChatCompletionRequest
    job: GenerationJob
    num_top: int | None  # top logprobs per token; None unless logprobs is true
    reasoning: ChatReasoning | None
    mode: ToolMode
    parser: ToolParser

    async def stream(
        self, encode: Callable[[AsyncIterator[ChatCompletionStreamResponse]], AsyncIterator[bytes]]
    ) -> AsyncIterator[bytes]:
        """The response body: `encode` turns the chunks into bytes (raising APIError for a
        failure after the first output). Errors before any output raise here."""
        server = self.job.state.config.server
        outs = self.job.outputs(server.stream_interval_ms / 1000)
        return await open_stream(
            outs, server.sse_keepalive_s, lambda first: encode(self._chunks(first, outs))
        )

    async def response(self, request: Request) -> ChatCompletionResponse:
        job, state, reasoning = self.job, self.job.state, self.reasoning
        choices, prompt_lps, usage = await until_disconnect(request, collect(job))
        tok = state.tokenizer
        out_choices = []
        for idx, ch in sorted(choices.items()):
            text = "".join(ch.text)
            # The think block comes off first: a tool call is read from the answer only (R1
            # writes its calls after </think>).
            split = None if reasoning is None else reasoning.split(text)
            answer = text if split is None else split.content or ""
            message, finish = _message(answer, ch.finish_reason, self.mode, self.parser)
            if split is not None:
                message.reasoning_content = message.reasoning = split.reasoning_content
                if split.content is None and not message.tool_calls:
                    message.content = None
            lp = None
            if self.num_top is not None:
                lp = chat_logprobs(ch.token_ids, ch.logprobs, self.num_top, tok)
            ids = list(ch.token_ids) if self.req.return_token_ids else None
            out_choices.append(
                ChatCompletionChoice(
                    index=idx, message=message, logprobs=lp, finish_reason=finish, token_ids=ids
                )
            )
        usage_info = usage.usage()
        if reasoning is not None:
            usage_info.completion_tokens_details = reasoning.details(
                ch.token_ids for ch in choices.values()
            )
        req, prompt_ids = self.req, job.inputs[0].token_ids
        plp = None
        if req.prompt_logprobs is not None:  # vLLM's: of the rendered conversation
            plp = prompt_logprobs_json(prompt_lps.get(0), prompt_ids, req.prompt_logprobs)
        return ChatCompletionResponse(
            id=job.request_id, model=state.served_name, choices=out_choices, usage=usage_info,
            prompt_token_ids=list(prompt_ids) if req.return_token_ids else None,
            prompt_logprobs=plp,
        )  # fmt: skip

    def _chunks(
        self, first: tuple, rest: AsyncIterator
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        return _stream(self, first, rest)


@functools.cache
def _special_texts(tokenizer) -> frozenset[str]:
    # Once per tokenizer (the server holds one): Gemma's vocabulary has thousands of specials.
    ids = getattr(tokenizer, "all_special_ids", ())
    return frozenset(tokenizer.convert_ids_to_tokens(sorted(ids))) if ids else frozenset()


def _message(
    text: str, finish: str | None, mode: ToolMode, parser: ToolParser
) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's message (content and tool calls) and its finish reason."""
    if mode.kind == "none":
        return ChatResponseMessage(content=text), finish
    content, calls = read_calls(mode, parser, text) if finish != "length" else (text, [])
    tool_calls = [
        ChatToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    if tool_calls and finish == "stop":
        finish = "tool_calls"
    return ChatResponseMessage(content=content, tool_calls=tool_calls or None), finish


async def _stream(
    run: ChatRun, first: tuple, rest: AsyncIterator
) -> AsyncIterator[ChatCompletionStreamResponse]:
    """The chunks of a streamed chat answer; an APIError (a failure after the first output)
    propagates to the encoder."""
    job, req, num_top, reasoning = run.job, run.req, run.num_top, run.reasoning
    mode, parser = run.mode, run.parser
    continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    ids = bool(req.return_token_ids)  # vLLM's: the prompt's ids first, each delta's ids
    prompt_ids = list(job.inputs[0].token_ids) if ids else None
    prompt_lps: PromptLogprobs | None = None  # vLLM's prompt_logprobs, for the next chunk
    state = job.state
    tok = state.tokenizer
    head = {"id": job.request_id, "created": int(time.time()), "model": state.served_name}
    choices: dict[int, ChoiceState] = {}
    tool_streams: dict[int, ToolStream] = {}
    usage = UsageCounter()
    splitters: dict[int, ReasoningSplitter] = {}  # per choice, with a reasoning parser

    def usage_now() -> UsageInfo:
        info = usage.usage()
        if reasoning is not None:
            info.completion_tokens_details = reasoning.details(
                ch.token_ids for ch in choices.values()
            )
        return info

    def chunk(choice: ChatCompletionStreamChoice) -> ChatCompletionStreamResponse:
        nonlocal prompt_ids, prompt_lps
        extra = {"usage": usage_now()} if continuous_usage else {}
        if prompt_ids is not None:  # on the stream's first chunk only
            extra["prompt_token_ids"], prompt_ids = prompt_ids, None
        if prompt_lps is not None:  # on the chunk after they arrive (the first)
            extra["prompt_logprobs"], prompt_lps = prompt_lps, None
        return ChatCompletionStreamResponse(**head, choices=[choice], **extra)

    async def all_outputs() -> AsyncIterator[tuple]:
        yield first
        async for item in rest:
            yield item

    try:
        async for _, out in all_outputs():
            usage.add(0, out)
            if out.prompt_logprobs is not None and req.prompt_logprobs is not None:
                prompt_lps = prompt_logprobs_json(
                    out.prompt_logprobs, job.inputs[0].token_ids, req.prompt_logprobs
                )
            if reasoning is not None:  # the ids usage counted, for its reasoning tokens
                for c in out.outputs:
                    choices.setdefault(c.index, ChoiceState()).token_ids.extend(c.token_ids)
            for c in out.outputs:
                ch = choices.setdefault(c.index, ChoiceState())
                if ch.finish_reason is not None:
                    continue  # a finished sibling repeats its finish while others run
                err = finish_error(c.finish_reason, job.timeout_s, state, job.request_id)
                if err is not None:
                    raise err
                if not ch.started:
                    ch.started = True
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=c.index, delta=DeltaMessage(role="assistant", content="")
                        )
                    )
                ch.finish_reason = c.finish_reason
                final = c.finish_reason is not None
                text, calls, finish = c.text, None, c.finish_reason
                deltas: list[DeltaMessage] = []
                if reasoning is not None:  # the think block first; tool calls read the answer
                    splitter = splitters.setdefault(c.index, reasoning.splitter())
                    split = ChatReasoning.feed(splitter, c.text, final)
                    text = split.content
                    if split.reasoning:
                        deltas.append(
                            DeltaMessage(
                                reasoning_content=split.reasoning, reasoning=split.reasoning
                            )
                        )
                if mode.kind != "none":
                    ts = tool_streams.setdefault(c.index, ToolStream(mode, parser))
                    text, tool_deltas = ts.feed(text, final=final)
                    calls = [d.to_json() for d in tool_deltas] or None
                    if ts.num_calls and finish == "stop":
                        finish = "tool_calls"
                if text or calls:
                    deltas.append(DeltaMessage(content=text or None, tool_calls=calls))
                if (
                    not deltas
                    and finish is None
                    and (num_top is None and not ids or not c.token_ids)
                ):
                    continue  # nothing to show yet (text held back at a stop string or a tag)
                lp = None
                if num_top is not None and c.token_ids:
                    lp = chat_logprobs(c.token_ids, c.logprobs or [], num_top, tok)
                *before, last = deltas or [DeltaMessage()]
                for delta in before:  # reasoning ahead of the answer in the same piece
                    yield chunk(ChatCompletionStreamChoice(index=c.index, delta=delta))
                yield chunk(
                    ChatCompletionStreamChoice(
                        index=c.index, delta=last, logprobs=lp, finish_reason=finish,
                        token_ids=list(c.token_ids) if ids else None,
                    )
                )  # fmt: skip
        if req.include_usage:
            yield ChatCompletionStreamResponse(**head, choices=[], usage=usage_now())
    finally:
        with contextlib.suppress(Exception):
            await rest.aclose()  # type: ignore[attr-defined]
