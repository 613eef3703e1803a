"""EngineClient: the one engine interface the server holds; per-request queues fed by one output handler.

Two engines sit behind it: `client/in_thread.py` runs the EngineLoop on a thread of this process,
`client/supervised.py` runs it in a supervised engine process. Both hand each StepOutputs to
`engine_message`, on the event loop, which puts every RequestDelta on its request's queue; the
server's SSE writer reads that queue directly (`submit`): no task or second queue in between.

NOTE: this module, and everything it imports, must not import torch: the API process of a
supervised `tidal serve` holds this interface and never loads the model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tidal.engine.errors import EngineError, QueueFullError
from tidal.engine.messages import AbortRequest, AddRequest, StepOutputs, ToEngine
from tidal.engine.output import RequestDelta
from tidal.engine.stats import StepStats
from tidal.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Throughput behind Retry-After and deadline admission: finishes in the last minute, and no
# estimate until a few requests have finished (a rate from one or two would swing wildly).
_RATE_WINDOW_S = 60.0
_RATE_MIN_SAMPLES = 4


class EngineInterrupted(EngineError):
    """The engine process died, hung ("died", "hung": it restarts; retrying should succeed) or
    the restart budget is spent ("gave_up": this server is exiting) while the request ran.

    `retry_after_s` is the estimated time until a new engine serves, None when none will."""

    def __init__(self, message: str, reason: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


# What a request's queue receives: (the caller's tag, a delta), or (tag, the exception ending it).
Item = tuple[int, RequestDelta | BaseException]


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[Item]  # the caller's: one per API request, shared by its prompts
    tag: int
    add: AddRequest  # kept so a request that has not started can run again on a new engine
    started: bool = False  # an output reached the caller: it cannot be replayed


class EngineClient:
    """The asyncio face of one engine; subclasses say where its EngineLoop runs.

    A subclass implements `_send` (a command to the loop), `start`, `shutdown` and `alive`, and
    calls `engine_message` on the event loop with each StepOutputs. Everything else (streams,
    failures, statistics, the hooks) is here, once.

    Hooks (all on the event loop): `on_step(StepStats)`, `on_output(RequestDelta)`,
    `on_up(bool)`, `on_restart()`, `on_request_failed(reason)`, `on_fatal()`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.on_step: Callable[[StepStats], None] | None = None
        self.on_output: Callable[[RequestDelta], None] | None = None
        self.on_up: Callable[[bool], None] | None = None
        self.on_restart: Callable[[], None] | None = None
        self.on_request_failed: Callable[[str], None] | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.ready = False  # set by the server once warm-up is done
        self.tokenizer = None  # tidal.loader.tokenizer.Tokenizer
        self._streams: dict[str, _Stream] = {}
        self._stats: StepStats | None = None
        self._clock = clock
        self._finished_at: deque[float] = deque(maxlen=1024)  # clock times of recent finishes

    # ---- what a subclass provides ---------------------------------------------------------------

    def _send(self, cmd: ToEngine) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Start the engine; call from the event loop that will consume outputs."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Stop the engine; requests still in flight fail with EngineError."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def engine_pid(self) -> int | None:
        """The pid of a separate engine process while it serves; None otherwise."""
        return None

    @property
    def fatal(self) -> str | None:
        """Why the engine is gone for good (the restart budget is spent), or None."""
        return None

    def _check_can_generate(self) -> None:
        """Raise the error a new request gets when the engine cannot take it."""
        if not self.alive:
            raise EngineError("the engine is not running")

    # ---- state --------------------------------------------------------------------------------

    @property
    def stats(self) -> StepStats | None:
        """The latest step's statistics the engine reported."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def replicas(self) -> tuple[EngineClient, ...]:
        """The engines behind this client, each with its own process and metrics: this one
        alone, or the replicas a data-parallel client routes between (router/replicated.py)."""
        return (self,)

    def holds(self, request_id: str) -> bool:
        """Whether this client delivers the request's outputs (it is in flight here)."""
        return request_id in self._streams

    def completions_per_s(self) -> float | None:
        """Requests finished per second over the last minute; None until a few have finished."""
        now = self._clock()
        while self._finished_at and now - self._finished_at[0] > _RATE_WINDOW_S:
            self._finished_at.popleft()
        span_s = now - self._finished_at[0] if self._finished_at else 0.0
        if len(self._finished_at) < _RATE_MIN_SAMPLES or span_s <= 0:
            return None
        return len(self._finished_at) / span_s

    # ---- requests -----------------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        queue: asyncio.Queue[Item],
        *,
        tag: int = 0,
        prompt: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        timeout_s: float | None = None,
        queue_timeout_s: float | None = None,
    ) -> None:
        """Queue one request; its deltas arrive on `queue` as (tag, RequestDelta), the last one
        finished, or end with (tag, exception): QueueFullError when the waiting queue is full,
        ValueError for a prompt the engine can never serve, EngineError when the engine fails.

        Raises EngineError (or EngineInterrupted) when the engine cannot take requests, and
        ValueError for a request_id already in flight. A caller that stops reading before the
        finished delta must `cancel` the request, so its KV is freed at once.
        """
        self._check_can_generate()
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is invalid: it is already in use")
        add = AddRequest(
            request_id,
            list(prompt_token_ids),
            params,
            prompt,
            priority,
            session_id,
            timeout_s,
            queue_timeout_s,
        )
        self._streams[request_id] = _Stream(queue, tag, add)
        self._send(add)

    def cancel(self, request_id: str) -> None:
        """Stop delivering a request's outputs and abort it in the engine; finished ids are ignored."""
        if self._streams.pop(request_id, None) is not None:
            self._send(AbortRequest(request_id))

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        **kwargs: object,
    ) -> AsyncIterator[RequestDelta]:
        """Delta outputs of one request (`submit`'s keyword arguments); ends after the finished
        one and raises its error. Closing the iterator early aborts the request."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self.submit(prompt_token_ids, params, request_id, queue, **kwargs)  # type: ignore[arg-type]
        finished = False
        try:
            while True:
                _, item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request (its iterator then ends with an aborted output); unknown ids are ignored."""
        self._send(AbortRequest(request_id))

    def interrupt_all(self, detail: str) -> int:
        """End every request in flight with EngineError(detail) and abort it in the engine; the count."""
        num = len(self._streams)
        for request_id in list(self._streams):
            self._send(AbortRequest(request_id))
        self._fail_all(EngineError(detail), reason=None)
        return num

    def take_unstarted(self) -> list[_Stream]:
        """Remove and return the requests no output of which has reached the caller (their engine
        died: a data-parallel client runs them on another replica with `adopt`)."""
        taken = [s for s in self._streams.values() if not s.started]
        for stream in taken:
            del self._streams[stream.add.request_id]
        return taken

    def adopt(self, stream: _Stream) -> None:
        """Run a request another client gave up with `take_unstarted`; its outputs go to the
        same queue. Raises like `submit` when this engine cannot take it."""
        self._check_can_generate()
        request_id = stream.add.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is invalid: it is already in use")
        self._streams[request_id] = stream
        self._send(stream.add)

    # ---- the output handler (event loop) ------------------------------------------------------

    def engine_message(self, msg: object) -> None:
        """One StepOutputs from the engine loop: each delta onto its request's queue."""
        if not isinstance(msg, StepOutputs):
            log.error("unexpected message from the engine: %r", type(msg).__name__)
            return
        for out in msg.outputs:
            if self.on_output is not None:
                _safely(self.on_output, out)
            if out.finished:
                self._finished_at.append(self._clock())
                stream = self._streams.pop(out.request_id, None)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.started = True
                stream.queue.put_nowait((stream.tag, out))
        for f in msg.failures:
            stream = self._streams.pop(f.request_id, None)
            if stream is None:
                continue
            if f.kind == "queue_full":
                error: BaseException = QueueFullError(f.message)
            elif f.kind == "invalid":
                error = ValueError(f.message)
            else:
                error = EngineError(f.message)
                self._count_failed("engine_error")
            stream.queue.put_nowait((stream.tag, error))
        if msg.stats is not None:
            self._stats = msg.stats
            if self.on_step is not None:
                _safely(self.on_step, msg.stats)

    def _fail_all(self, error: BaseException, reason: str | None) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait((stream.tag, error))
            if reason is not None:
                self._count_failed(reason)
        self._streams.clear()

    def _count_failed(self, reason: str) -> None:
        if self.on_request_failed is not None:
            _safely(self.on_request_failed, reason)


def _safely(fn: Callable, arg: object) -> None:
    try:
        fn(arg)
    except Exception:  # metrics must never break serving
        log.exception("engine client hook failed")
