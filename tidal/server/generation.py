"""Running one API request's prompts on the engine client: one output queue, errors, deadlines, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from starlette.requests import Request

from tidal.client.engine_client import EngineInterrupted
from tidal.engine.errors import EngineError, QueueFullError
from tidal.engine.output import CompletionOutput, Logprob, RequestDelta
from tidal.sampling_params import SamplingParams
from tidal.server.errors import (
    APIError,
    bad_request,
    deadline_exceeded,
    engine_restarted,
    engine_unavailable,
    internal_error,
    not_ready,
    queue_full,
    queue_timeout,
)
from tidal.server.guards import MAX_RETRY_AFTER_S, check_deadline, retry_after_s
from tidal.server.inputs import PromptInput
from tidal.server.responses import UsageInfo
from tidal.server.sse import SSE_DONE, sse_comment, sse_error_event
from tidal.server.state import ServerState

_T = TypeVar("_T")


class ClientGone(Exception):
    """The client disconnected before the response was ready; nothing is sent."""


# One line per finished engine request (server.log_requests): `tidal.server.requests`
request_log = logging.getLogger("tidal.server.requests")


def effective_timeout_s(requested_s: float | None, server_s: float | None) -> float | None:
    """A request's own timeout_s may only shorten server.request_timeout_s."""
    if requested_s is None:
        return server_s
    return requested_s if server_s is None else min(requested_s, server_s)


def finish_error(
    reason: str | None, timeout_s: float | None, state: ServerState, request_id: str
) -> APIError | None:
    """The error for endings that are not a normal "stop"/"length" finish, else None."""
    if reason in (None, "stop", "length"):
        return None
    if reason == "deadline":
        return deadline_exceeded(timeout_s or 0.0)
    if reason == "rejected":
        max_queue = state.config.engine.scheduler.max_queue
        return queue_full(max_queue, retry_after_s(state, max_queue))
    if reason == "abort":
        return not_ready("The request was aborted by the server")
    return internal_error(request_id)


@dataclass(slots=True)
class GenerationJob:
    """One API request: its prompts, each run as an engine request with `params.n` choices."""

    state: ServerState
    request_id: str
    inputs: list[PromptInput]
    params: SamplingParams
    priority: int = 0
    session_id: str | None = None
    timeout_s: float | None = None
    queue_timeout_s: float | None = None

    @property
    def n(self) -> int:
        return self.params.n

    def _error(self, e: BaseException) -> tuple[APIError, str | None]:
        """The API error for an engine request's failure, and its finished reason (None: not
        counted as finished, the request was refused)."""
        state = self.state
        if isinstance(e, QueueFullError):
            max_queue = state.config.engine.scheduler.max_queue
            return queue_full(max_queue, retry_after_s(state, max_queue)), None
        if isinstance(e, ValueError):
            return bad_request(str(e), "prompt", "invalid_value"), None
        if isinstance(e, EngineError):
            return self._engine_error(e), "error"
        raise e

    def _queue_expired(self, out: RequestDelta, started_s: float) -> bool:
        """A choice ended "deadline" before the whole-request timeout_s could have passed: its
        queue deadline did (the engine's clock starts after ours, so it runs no further)."""
        if self.queue_timeout_s is None:
            return False
        if not any(c.finish_reason == "deadline" for c in out.outputs):
            return False
        elapsed_s = asyncio.get_running_loop().time() - started_s
        return self.timeout_s is None or elapsed_s < self.timeout_s

    def _engine_error(self, e: EngineError) -> APIError:
        if self.state.draining:
            # Past the drain timeout the server ends what still runs (app.py's drain cut).
            return not_ready("The server is shutting down")
        if isinstance(e, EngineInterrupted):
            if e.retry_after_s is None:
                return engine_unavailable(self.request_id)
            return engine_restarted(min(e.retry_after_s, MAX_RETRY_AFTER_S), self.request_id)
        return internal_error(self.request_id)

    async def outputs(self, interval_s: float = 0.0) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(prompt index, delta output) from every prompt, as they come; raises APIError.

        Every prompt's engine request feeds one queue, read here: the engine client's output
        handler puts each delta on it, tagged with the prompt index.
        With interval_s > 0 (server.stream_interval_ms) a prompt's deltas are merged and
        yielded at most once per interval_s: the first output and a finished one go out at once.
        Closing it (or cancelling the task iterating it) aborts every engine request still running.
        """
        state = self.state
        if state.draining:
            raise not_ready("The server is shutting down")
        check_deadline(self.timeout_s, state)
        engine = state.engine
        out_q: asyncio.Queue = asyncio.Queue()
        ids = [f"{self.request_id}-{i}" for i in range(len(self.inputs))]
        trackers = [state.metrics.track() for _ in self.inputs]

        def finished(i: int, reason: str) -> None:
            trackers[i].finish(reason)
            if state.config.server.log_requests:
                request_log.info("request %s: %s", ids[i], trackers[i].describe(reason))

        running: set[int] = set()  # prompts submitted and not yet finished or failed
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        held: dict[int, RequestDelta] = {}  # merged deltas not yet sent, by prompt index
        sent_s = -math.inf
        if self.params.structured_outputs is not None:
            kind = self.params.structured_outputs.kind
            state.metrics.constrained_requests.labels(kind=kind).inc(len(self.inputs))
        try:
            for i, inp in enumerate(self.inputs):
                try:
                    engine.submit(
                        inp.token_ids,
                        self.params,
                        ids[i],
                        out_q,
                        tag=i,
                        prompt=inp.text,
                        priority=self.priority,
                        session_id=self.session_id,
                        timeout_s=self.timeout_s,
                        queue_timeout_s=self.queue_timeout_s,
                    )
                except (ValueError, EngineError) as e:
                    err, reason = self._error(e)
                    if reason is not None:
                        finished(i, reason)
                    raise err from None
                running.add(i)
            while running:
                if held:
                    try:
                        wait_s = max(0.0, sent_s + interval_s - loop.time())
                        i, item = await asyncio.wait_for(out_q.get(), wait_s)
                    except TimeoutError:
                        for i in sorted(held):
                            yield i, held.pop(i)
                        sent_s = loop.time()
                        continue
                else:
                    i, item = await out_q.get()
                if isinstance(item, BaseException):
                    running.discard(i)
                    err, reason = self._error(item)
                    if reason is not None:
                        finished(i, reason)
                    raise err
                trackers[i].update(item)
                if item.finished:
                    running.discard(i)
                    finished(i, item.outputs[0].finish_reason or "stop")
                    if self._queue_expired(item, started_s):
                        raise queue_timeout(self.queue_timeout_s or 0.0, retry_after_s(state))
                if i in held:
                    item = merge_deltas(held.pop(i), item)
                due = loop.time() >= sent_s + interval_s
                if due or item.finished or item.prompt_logprobs is not None:
                    yield i, item
                    sent_s = loop.time()
                else:
                    held[i] = item
        finally:
            for i in running:
                engine.cancel(ids[i])
                finished(i, "abort")


def merge_deltas(a: RequestDelta, b: RequestDelta) -> RequestDelta:
    """One delta output holding a's new tokens then b's (b is the later one)."""
    by_index = {c.index: c for c in a.outputs}
    merged: list[CompletionOutput] = []
    for cb in b.outputs:
        ca = by_index.pop(cb.index, None)
        if ca is None:
            merged.append(cb)
            continue
        logprobs = None
        if ca.logprobs is not None or cb.logprobs is not None:
            logprobs = (ca.logprobs or []) + (cb.logprobs or [])
        merged.append(
            replace(
                cb,
                text=ca.text + cb.text,
                token_ids=ca.token_ids + cb.token_ids,
                logprobs=logprobs,
                finish_reason=cb.finish_reason or ca.finish_reason,
                stop_reason=cb.stop_reason if cb.finish_reason else ca.stop_reason,
            )
        )
    merged.extend(by_index.values())  # choices b did not touch (n > 1)
    merged.sort(key=lambda c: c.index)
    prompt_logprobs = b.prompt_logprobs if b.prompt_logprobs is not None else a.prompt_logprobs
    metrics = b.metrics if b.metrics is not None else a.metrics
    return replace(b, outputs=merged, prompt_logprobs=prompt_logprobs, metrics=metrics)


async def open_stream(
    outs: AsyncIterator[tuple[int, RequestDelta]],
    keepalive_s: float,
    body: Callable[[tuple[int, RequestDelta]], AsyncIterator[bytes]],
) -> AsyncIterator[bytes]:
    """The bytes of a streamed response, once it is known to start.

    Waits up to keepalive_s (server.sse_keepalive_s; 0: as long as it takes) for the first
    output: errors before it (429, 400) raise here and keep their HTTP status. A request still
    queued after keepalive_s starts its 200 response with SSE comments, one per keepalive_s, so
    clients and proxies do not time out; an error after that is sent in the stream.
    """
    first = asyncio.ensure_future(anext(outs))
    try:
        await asyncio.wait({first}, timeout=keepalive_s if keepalive_s > 0 else None)
        if first.done():
            return body(first.result())
    except BaseException:
        await _close(first, outs)
        raise
    return _keepalive_then(first, outs, keepalive_s, body)


async def _keepalive_then(
    first: asyncio.Future,
    outs: AsyncIterator[tuple[int, RequestDelta]],
    keepalive_s: float,
    body: Callable[[tuple[int, RequestDelta]], AsyncIterator[bytes]],
) -> AsyncIterator[bytes]:
    try:
        while not first.done():
            yield sse_comment("queued")
            await asyncio.wait({first}, timeout=keepalive_s)
        try:
            item = first.result()
        except APIError as e:
            yield sse_error_event(e)
            yield SSE_DONE
            return
        async for chunk in body(item):
            yield chunk
    finally:
        if not first.done():  # the client left while the request was queued
            await _close(first, outs)


async def _close(first: asyncio.Future, outs: AsyncIterator) -> None:
    """Cancel the pending first read, then close the outputs (aborting their engine requests)."""
    first.cancel()
    with contextlib.suppress(BaseException):
        await first
    await outs.aclose()  # type: ignore[attr-defined]


@dataclass(slots=True)
class ChoiceState:
    """One choice's accumulated output (non-streaming) or stream bookkeeping."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # streaming: role chunk / echo sent
    text_offset: int = 0  # streaming completions: characters sent so far


@dataclass(slots=True)
class UsageCounter:
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, i: int, out: RequestDelta) -> None:
        self.prompt_tokens[i] = out.num_prompt_tokens
        self.cached_tokens[i] = out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> UsageInfo:
        return UsageInfo.of(
            sum(self.prompt_tokens.values()),
            self.completion_tokens,
            sum(self.cached_tokens.values()),
        )


async def collect(
    job: GenerationJob,
) -> tuple[dict[int, ChoiceState], dict[int, list[dict[int, Logprob] | None]], UsageCounter]:
    """Run a job to the end: choices by index, each prompt's prompt logprobs (when asked for),
    and usage."""
    choices: dict[int, ChoiceState] = {}
    prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = {}
    usage = UsageCounter()
    async with contextlib.aclosing(job.outputs()) as outs:
        async for i, out in outs:
            if out.prompt_logprobs is not None:  # they come once per prompt
                prompt_logprobs[i] = out.prompt_logprobs
            usage.add(i, out)
            for c in out.outputs:
                ch = choices.setdefault(i * job.n + c.index, ChoiceState())
                ch.text.append(c.text)
                ch.token_ids.extend(c.token_ids)
                if c.logprobs is not None:
                    ch.logprobs.extend(c.logprobs)
                if c.finish_reason is not None and ch.finish_reason is None:
                    ch.finish_reason = c.finish_reason
                    err = finish_error(c.finish_reason, job.timeout_s, job.state, job.request_id)
                    if err is not None:
                        raise err
    return choices, prompt_logprobs, usage


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the server's receive() only returns when the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[_T]) -> _T:
    """Await `work`; if the client disconnects first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()
