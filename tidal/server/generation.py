"""Running one API request's prompts on the AsyncEngine: merged output streams, errors, deadlines, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from tidal.engine.async_engine import EngineError, QueueFullError
from tidal.engine.client import EngineInterrupted
from tidal.engine.output import Logprob, RequestOutput
from tidal.engine.sampling_params import SamplingParams
from tidal.server.errors import (
    APIError,
    bad_request,
    deadline_exceeded,
    engine_restarted,
    engine_unavailable,
    internal_error,
    not_ready,
    queue_full,
)
from tidal.server.guards import MAX_RETRY_AFTER_S, check_deadline, retry_after_s
from tidal.server.inputs import PromptInput
from tidal.server.responses import UsageInfo
from tidal.server.state import ServerState

_T = TypeVar("_T")


class ClientGone(Exception):
    """The client disconnected before the response was ready; nothing is sent."""


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

    @property
    def n(self) -> int:
        return self.params.n

    async def _pump(self, i: int, inp: PromptInput, out_q: asyncio.Queue) -> None:
        state = self.state
        tracker = state.metrics.track()
        reason: str | None = "abort"  # unless the engine says otherwise
        try:
            gen = state.engine.generate(
                inp.token_ids,
                self.params,
                f"{self.request_id}-{i}",
                prompt=inp.text,
                priority=self.priority,
                session_id=self.session_id,
                timeout_s=self.timeout_s,
            )
            async with contextlib.aclosing(gen):
                async for out in gen:
                    tracker.update(out)
                    if out.finished:
                        reason = out.outputs[0].finish_reason or "stop"
                    out_q.put_nowait((i, out))
            out_q.put_nowait((i, None))
        except QueueFullError:
            reason = None
            max_queue = state.config.engine.scheduler.max_queue
            out_q.put_nowait((i, queue_full(max_queue, retry_after_s(state, max_queue))))
        except ValueError as e:
            reason = None
            out_q.put_nowait((i, bad_request(str(e), "prompt", "invalid_value")))
        except EngineError as e:
            reason = "error"
            out_q.put_nowait((i, self._engine_error(e)))
        finally:
            if reason is not None:
                tracker.finish(reason)

    def _engine_error(self, e: EngineError) -> APIError:
        if self.state.draining:
            # Past the drain timeout the server ends what still runs (app.py's drain cut).
            return not_ready("The server is shutting down")
        if isinstance(e, EngineInterrupted):
            if e.retry_after_s is None:
                return engine_unavailable(self.request_id)
            return engine_restarted(min(e.retry_after_s, MAX_RETRY_AFTER_S), self.request_id)
        return internal_error(self.request_id)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) from every prompt, as they come; raises APIError.

        Closing it (or cancelling the task iterating it) aborts every engine request still running.
        """
        if self.state.draining:
            raise not_ready("The server is shutting down")
        check_deadline(self.timeout_s, self.state)
        out_q: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._pump(i, inp, out_q)) for i, inp in enumerate(self.inputs)
        ]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await out_q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, APIError):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


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

    def add(self, i: int, out: RequestOutput) -> None:
        self.prompt_tokens[i] = len(out.prompt_token_ids)
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
) -> tuple[dict[int, ChoiceState], dict[int, RequestOutput], UsageCounter]:
    """Run a job to the end: choices by index, each prompt's last output, and usage."""
    choices: dict[int, ChoiceState] = {}
    last: dict[int, RequestOutput] = {}
    usage = UsageCounter()
    async with contextlib.aclosing(job.outputs()) as outs:
        async for i, out in outs:
            last[i] = out
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
    return choices, last, usage


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
