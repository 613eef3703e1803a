"""EngineClient: AsyncEngine's API backed by a supervised engine process that is restarted when it dies or hangs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tidal.config.engine import EngineConfig
from tidal.engine.async_engine import EngineError, QueueFullError
from tidal.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineReady,
    StepOutputs,
)
from tidal.engine.output import RequestOutput
from tidal.engine.process import FAULT_ENV
from tidal.engine.stats import StepStats
from tidal.sampling_params import SamplingParams
from tidal.supervisor.handle import EngineStartError
from tidal.supervisor.restart_policy import RestartPolicy
from tidal.supervisor.supervisor import Supervisor

log = logging.getLogger(__name__)

# Throughput behind Retry-After and deadline admission: finishes in the last minute, and no
# estimate until a few requests have finished (a rate from one or two would swing wildly).
_RATE_WINDOW_S = 60.0
_RATE_MIN_SAMPLES = 4
# Starting an engine process costs more than loading the model: the interpreter, torch's import
# and warm-up. Added to the load time for a restart estimate before one has been measured.
_SPAWN_OVERHEAD_S = 2.0


class EngineInterrupted(EngineError):
    """The engine process died, hung ("died", "hung": it restarts; retrying should succeed) or
    the restart budget is spent ("gave_up": this server is exiting) while the request ran.

    `retry_after_s` is the estimated time until a new engine serves, None when none will."""

    def __init__(self, message: str, reason: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException]
    add: AddRequest  # kept so a request that has not started can run again on a new engine
    started: bool = False  # an output reached the caller: it cannot be replayed


class EngineClient:
    """The asyncio face of a supervised engine process; the same public API as AsyncEngine.

    When the engine dies or hangs, `alive` turns False at once; requests that already produced
    output fail with EngineInterrupted (counted under reason "engine_died" / "engine_hung");
    requests that produced nothing stay queued here and are sent again to the restarted engine.
    When the restart budget is spent every request fails ("engine_gave_up") and `on_fatal` runs.
    A request the engine itself fails (a step raised) ends with a plain EngineError
    ("engine_error").

    Hooks (all on the event loop): `on_step(StepStats)`, `on_output(RequestOutput)`,
    `on_up(bool)`, `on_restart()`, `on_request_failed(reason)`, `on_fatal()`.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        policy: RestartPolicy | None = None,
        watchdog_timeout_s: float = 30.0,
        warmup_on_restart: bool = True,
        fault_spec: str | None = None,
        log_level: int = logging.INFO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from tidal.engine.builder import model_path

        # Resolve the checkpoint once here: the bundled model may be assembled on first use,
        # and the engine process must not race the API process (or itself, after a restart).
        path = model_path(config)
        self.config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, path=path)
        )
        self.model_path = path
        if fault_spec is None:
            fault_spec = os.environ.get(FAULT_ENV) or None
        self.supervisor = Supervisor(
            self.config,
            self,
            policy=policy,
            watchdog_timeout_s=watchdog_timeout_s,
            warmup_on_restart=warmup_on_restart,
            fault_spec=fault_spec,
            log_level=log_level,
            clock=clock,
        )
        self.on_step: Callable[[StepStats], None] | None = None
        self.on_output: Callable[[RequestOutput], None] | None = None
        self.on_up: Callable[[bool], None] | None = None
        self.on_restart: Callable[[], None] | None = None
        self.on_request_failed: Callable[[str], None] | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.ready = False  # set by the server once warm-up is done
        self.info: EngineReady | None = None
        self.tokenizer = None  # tidal.loader.tokenizer.Tokenizer, loaded here by launch()
        self._streams: dict[str, _Stream] = {}
        self._stats: StepStats | None = None
        self._started = False
        self._closed = False
        self._clock = clock
        self._finished_at: deque[float] = deque(maxlen=1024)  # clock times of recent finishes
        self._down_at: float | None = None  # clock time the engine last went down
        self.last_restart_s: float | None = None  # down -> up of the last restart, measured

    # ---- lifecycle ----------------------------------------------------------------------------

    def launch(self) -> EngineReady:
        """Start the engine process and load the tokenizer here meanwhile; blocks until ready.

        Raises ValueError for a setting the engine rejected, EngineError if it failed otherwise.
        """
        from concurrent.futures import ThreadPoolExecutor

        from tidal.loader.model_loader import read_arch
        from tidal.loader.tokenizer import load_tokenizer

        with ThreadPoolExecutor(max_workers=1) as pool:
            engine = pool.submit(self.supervisor.launch)
            self.tokenizer = load_tokenizer(self.model_path, read_arch(self.model_path)[0].family)
            try:
                self.info = engine.result()
            except EngineStartError as e:
                if e.kind == "config":
                    raise ValueError(str(e)) from None
                raise EngineError(str(e)) from None
        return self.info

    def start(self) -> None:
        """Start watching the engine; call from the event loop that will consume outputs."""
        if self._started:
            return
        if self.info is None:
            self.launch()
        self._started = True
        self.supervisor.start()
        if self.on_up is not None:
            self.on_up(True)

    async def shutdown(self) -> None:
        """Stop the engine process; requests still in flight fail with EngineError."""
        if self._closed:
            return
        self._closed = True
        await self.supervisor.stop()
        self._fail_all(EngineError("the engine is shut down"), reason=None)
        if self.on_up is not None:
            self.on_up(False)

    @property
    def alive(self) -> bool:
        return self._started and not self._closed and self.supervisor.up

    @property
    def engine_pid(self) -> int | None:
        """The pid of the engine process while it serves; None while it is down or restarting."""
        return self.supervisor.pid if self.alive else None

    def restart_estimate_s(self) -> float:
        """How long until a restarted engine serves: the last restart as measured (down to up),
        else the coming backoff plus the first engine's load time and the spawn overhead."""
        if self.last_restart_s is not None:
            return self.last_restart_s
        budget = self.supervisor.budget
        p = budget.policy
        backoff_s = min(p.backoff_max_s, p.backoff_initial_s * 2**budget.num_recent)
        load_s = self.info.load_time_s if self.info is not None else 0.0
        return backoff_s + load_s + _SPAWN_OVERHEAD_S

    @property
    def fatal(self) -> str | None:
        """Why the supervisor gave up, or None."""
        return self.supervisor.fatal

    @property
    def stats(self) -> StepStats | None:
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

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

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        prompt: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        timeout_s: float | None = None,
        queue_timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request; ends after the finished one (see AsyncEngine.generate).

        While the engine restarts a new request waits here and runs on the new engine.
        """
        if self.fatal is not None:
            raise EngineInterrupted(self.fatal, "gave_up", None)
        if not self._started or self._closed:
            raise EngineError("the engine is not running")
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
        stream = _Stream(asyncio.Queue(), add)
        self._streams[request_id] = stream
        self.supervisor.send(add)  # while the engine is down, engine_up sends it
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.supervisor.send(AbortRequest(request_id))

    def interrupt_all(self, detail: str) -> int:
        """End every request in flight with EngineError(detail) and abort it in the engine; the count."""
        num = len(self._streams)
        for request_id in list(self._streams):
            self.supervisor.send(AbortRequest(request_id))
        self._fail_all(EngineError(detail), reason=None)
        return num

    async def abort(self, request_id: str) -> None:
        """Abort a request (its iterator then ends with an aborted output); unknown ids are ignored."""
        self.supervisor.send(AbortRequest(request_id))

    # ---- EngineListener (the supervisor calls these on the event loop) -------------------------

    def engine_message(self, msg: object) -> None:
        if not isinstance(msg, StepOutputs):
            log.error("unexpected message from the engine: %r", type(msg).__name__)
            return
        for out in msg.outputs:
            if self.on_output is not None:
                _safely(self.on_output, out)
            if out.finished:
                self._finished_at.append(self._clock())
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.started = True
                stream.queue.put_nowait(out)
        for f in msg.failures:
            stream = self._streams.get(f.request_id)
            if stream is None:
                continue
            if f.kind == "queue_full":
                error: BaseException = QueueFullError(f.message)
            elif f.kind == "invalid":
                error = ValueError(f.message)
            else:
                error = EngineError(f.message)
                self._count_failed("engine_error")
            stream.queue.put_nowait(error)
        if msg.stats is not None:
            self._stats = msg.stats
            if self.on_step is not None:
                _safely(self.on_step, msg.stats)

    def engine_down(self, reason: str, detail: str) -> None:
        if self.on_up is not None:
            self.on_up(False)
        self._down_at = self._clock()
        error = EngineInterrupted(
            f"{detail}; the request was interrupted and cannot be resumed",
            reason,
            self.restart_estimate_s(),
        )
        failed = kept = 0
        for request_id, stream in list(self._streams.items()):
            if stream.started:
                # Tokens already reached the caller: replaying would repeat or change them.
                del self._streams[request_id]
                stream.queue.put_nowait(error)
                self._count_failed(f"engine_{reason}")
                failed += 1
            else:
                kept += 1
        log.warning(
            "engine down: %d started requests failed, %d kept for the new engine", failed, kept
        )

    def engine_up(self, ready: EngineReady, restarted: bool) -> None:
        self.info = ready
        if restarted and self._down_at is not None:
            self.last_restart_s = self._clock() - self._down_at
        for stream in self._streams.values():
            self.supervisor.send(stream.add)
        if restarted and self.on_restart is not None:
            self.on_restart()
        if self.on_up is not None:
            self.on_up(True)

    def engine_fatal(self, detail: str) -> None:
        self._fail_all(EngineInterrupted(detail, "gave_up", None), reason="engine_gave_up")
        if self.on_fatal is not None:
            self.on_fatal()

    def has_work(self) -> bool:
        return bool(self._streams)

    # ---- helpers ------------------------------------------------------------------------------

    def _fail_all(self, error: BaseException, reason: str | None) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
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
