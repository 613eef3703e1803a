"""POST /v1/completions: legacy text completions, streamed as SSE or returned as one JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
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
from tidal.server.inputs import (
    PromptInput,
    check_logit_bias,
    check_max_tokens,
    check_request_size,
    completion_inputs,
)
from tidal.server.logprobs import completion_logprobs
from tidal.server.protocol import CompletionRequest, parse_request
from tidal.server.responses import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamResponse,
    prompt_logprobs_json,
    random_id,
)
from tidal.server.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_error_event, sse_event


async def create_completion(request: Request) -> Response:
    state, req = await admit(request, partial(parse_request, CompletionRequest))
    params = req.to_sampling_params(state.sampling_defaults)
    tok = state.tokenizer
    # Off the event loop: encoding a long prompt (the tokenizer's C code lets go of the GIL)
    # would hold every other stream for as long (seconds for a body of a few MiB).
    inputs = await asyncio.to_thread(completion_inputs, req, tok, state.limits)
    check_logit_bias(params, state.limits)
    for inp in inputs:
        check_max_tokens(params, len(inp.token_ids), state.limits, "max_tokens")
    lengths = [len(inp.token_ids) for inp in inputs]
    check_request_size(params, lengths, state.limits, state.config.server, "max_tokens")
    job = GenerationJob(
        state,
        random_id("cmpl"),
        inputs,
        params,
        priority=req.priority or 0,
        session_id=req.session_id,
        timeout_s=effective_timeout_s(req.timeout_s, state.config.server.request_timeout_s),
        queue_timeout_s=effective_timeout_s(
            req.queue_timeout_s, state.config.server.queue_timeout_s
        ),
    )
    echo = bool(req.echo)
    num_top = req.logprobs
    if req.stream:
        server = state.config.server
        outs = job.outputs(server.stream_interval_ms / 1000)
        # Errors before any output (429, 400) raise here and keep their status.
        body = await open_stream(
            outs,
            server.sse_keepalive_s,
            lambda first: _stream(job, first, outs, req),
        )
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    choices, prompt_logprobs, usage = await until_disconnect(request, collect(job))
    out_choices = []
    for idx in sorted(choices):
        ch = choices[idx]
        inp = inputs[idx // job.n]
        text = "".join(ch.text)
        lp = None
        if echo:
            prompt_text = _prompt_text(inp, tok)
            text = prompt_text + text
        if num_top is not None:
            lp = CompletionLogProbs()
            if echo:
                completion_logprobs(
                    inp.token_ids, prompt_logprobs.get(idx // job.n) or [], num_top, tok, 0, lp
                )
            offset = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0
            completion_logprobs(ch.token_ids, ch.logprobs, num_top, tok, offset, lp)
        asked = bool(req.return_token_ids)  # vLLM's: the prompt's and the choice's ids
        plp = None
        if req.prompt_logprobs is not None:  # vLLM's: the prompt's logprobs alone
            entries = prompt_logprobs.get(idx // job.n)
            plp = prompt_logprobs_json(entries, inp.token_ids, req.prompt_logprobs)
        out_choices.append(
            CompletionChoice(
                index=idx, text=text, logprobs=lp, finish_reason=ch.finish_reason,
                prompt_token_ids=list(inp.token_ids) if asked else None,
                token_ids=list(ch.token_ids) if asked else None, prompt_logprobs=plp,
            )
        )  # fmt: skip
    body = CompletionResponse(
        id=job.request_id, model=state.served_name, choices=out_choices, usage=usage.usage()
    )
    return Response(body.model_dump_json(), media_type="application/json")


def _prompt_text(inp: PromptInput, tok) -> str:
    return (
        inp.text if inp.text is not None else tok.decode(inp.token_ids, skip_special_tokens=False)
    )


async def _stream(
    job: GenerationJob, first: tuple, rest: AsyncIterator, req: CompletionRequest
) -> AsyncIterator[bytes]:
    echo, num_top, include_usage = bool(req.echo), req.logprobs, req.include_usage
    continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    ids, prompt_k = bool(req.return_token_ids), req.prompt_logprobs  # vLLM's extras
    state = job.state
    tok = state.tokenizer
    created = int(time.time())
    head = {"id": job.request_id, "created": created, "model": state.served_name}
    choices: dict[int, ChoiceState] = {}
    prompt_lps: dict[int, list] = {}  # by prompt index
    usage = UsageCounter()

    async def all_outputs() -> AsyncIterator[tuple]:
        yield first
        async for item in rest:
            yield item

    try:
        async for i, out in all_outputs():
            usage.add(i, out)
            for c in out.outputs:
                idx = i * job.n + c.index
                ch = choices.setdefault(idx, ChoiceState())
                if ch.finish_reason is not None:
                    continue  # a finished sibling repeats its finish while others run
                err = finish_error(c.finish_reason, job.timeout_s, state, job.request_id)
                if err is not None:
                    raise err
                text = c.text
                lp = None if num_top is None else CompletionLogProbs()
                prompt_ids = list(job.inputs[i].token_ids) if ids and not ch.started else None
                if out.prompt_logprobs is not None:  # once per prompt, for its choices
                    prompt_lps[i] = out.prompt_logprobs
                plp = None
                if prompt_k is not None and not ch.started:
                    entries = prompt_lps.get(i)
                    plp = prompt_logprobs_json(entries, job.inputs[i].token_ids, prompt_k)
                if echo and not ch.started:
                    inp = job.inputs[i]
                    prompt_text = _prompt_text(inp, tok)
                    text = prompt_text + text
                    if lp is not None:
                        completion_logprobs(
                            inp.token_ids, out.prompt_logprobs or [], num_top or 0, tok, 0, lp
                        )
                        ch.text_offset = len(prompt_text)
                ch.started = True
                if lp is not None:
                    completion_logprobs(
                        c.token_ids, c.logprobs or [], num_top or 0, tok, ch.text_offset, lp
                    )
                    ch.text_offset += sum(
                        len(t) for t in lp.tokens[len(lp.tokens) - len(c.token_ids) :]
                    )
                ch.finish_reason = c.finish_reason
                if not text and not c.token_ids and c.finish_reason is None:
                    continue
                chunk = CompletionStreamResponse(
                    **head,
                    choices=[
                        CompletionChoice(
                            index=idx,
                            text=text,
                            logprobs=lp,
                            finish_reason=c.finish_reason,
                            prompt_token_ids=prompt_ids,
                            token_ids=list(c.token_ids) if ids else None,
                            prompt_logprobs=plp,
                        )  # fmt: skip
                    ],
                    # vLLM's continuous_usage_stats: the counts so far on every chunk.
                    usage=usage.usage() if continuous_usage else None,
                )
                yield sse_event(chunk)
        if include_usage:
            yield sse_event(CompletionStreamResponse(**head, choices=[], usage=usage.usage()))
        yield SSE_DONE
    except APIError as e:
        yield sse_error_event(e)
        yield SSE_DONE
    finally:
        with contextlib.suppress(Exception):
            await rest.aclose()  # type: ignore[attr-defined]
