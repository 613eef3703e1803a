"""AsyncEngine: drives EngineCore in a background thread and streams each request's outputs to asyncio."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tidal.engine.core import EngineCore
from tidal.engine.output import RequestOutput
from tidal.engine.stats import StepStats
from tidal.request import RequestStatus
from tidal.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# When requests exist but a step scheduled nothing (and the scheduler named no hold time), wait
# this long for a command before stepping again, so a stalled batch never spins a core.
_IDLE_POLL_S = 0.002


class QueueFullError(Exception):
    """The engine's waiting queue is full (server.max_queue): the request was not queued."""


class EngineError(RuntimeError):
    """The engine failed while the request was in flight, or it is shut down."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int
    session_id: str | None
    timeout_s: float | None
    queue_timeout_s: float | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


_STOP = object()


class AsyncEngine:
    """The asyncio face of one EngineCore.

    Threads: the event loop only puts commands (add, abort, stop) on a thread-safe queue; the
    engine thread drains it before each step, runs `EngineCore.step()` (torch releases the GIL)
    and hands each step's outputs back with one `call_soon_threadsafe`, whose handler feeds the
    per-request asyncio queues. When nothing is in flight the engine thread blocks on the command
    queue. An exception in a step fails every in-flight request with EngineError (never a hang),
    frees their KV, and the engine carries on serving new requests.
    """

    def __init__(
        self, core: EngineCore, on_output: Callable[[RequestOutput], None] | None = None
    ) -> None:
        self.core = core
        self.on_output = on_output
        self.ready = False  # set by the server once warm-up is done
        self.num_step_errors = 0
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._in_engine: set[str] = set()  # engine thread only: ids added and not yet finished

    # ---- lifecycle (event loop) ---------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still in flight fail with EngineError."""
        thread = self._thread
        if thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(thread.join)
        self._thread = None
        self._fail_all(EngineError("the engine is shut down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def stats(self) -> StepStats | None:
        """The latest step's statistics (a frozen snapshot, safe to read from any thread)."""
        return self.core.last_stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event loop) ----------------------------------------------------------------

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
        """Delta outputs of one request; ends after the finished one.

        Raises QueueFullError when the waiting queue is full, ValueError for a prompt the engine
        can never serve, EngineError when the engine fails. Closing the iterator early (a client
        went away, a task was cancelled) aborts the request so its KV is freed at once.
        """
        if not self.alive:
            raise EngineError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is invalid: it is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(
            _Add(
                request_id,
                list(prompt_token_ids),
                params,
                prompt,
                priority,
                session_id,
                timeout_s,
                queue_timeout_s,
            )
        )
        finished = False
        try:
            while True:
                item = await stream.get()
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
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request (its iterator then ends with an aborted output); unknown ids are ignored."""
        self._commands.put(_Abort(request_id))

    # ---- the output handler (event loop) ------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput | tuple[str, BaseException]]) -> None:
        for out in outputs:
            item: RequestOutput | BaseException
            if isinstance(out, tuple):
                request_id, item = out
            else:
                request_id, item = out.request_id, out
                if self.on_output is not None:
                    try:
                        self.on_output(out)
                    except Exception:  # metrics must never break serving
                        log.exception("on_output failed")
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    def _post(self, outputs: list) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._apply(self._next_commands()):
                    return
                try:
                    outputs = self.core.step()
                except Exception as e:
                    self._on_step_error(e)
                    continue
                for out in outputs:
                    if out.finished:
                        self._in_engine.discard(out.request_id)
                self._post(outputs)
                if outputs and not self.core.has_unfinished():
                    # Publish idle stats (0 running, KV freed) now rather than at the next request.
                    self.core.step()
        except BaseException as e:  # an abort that itself failed: the engine is unusable
            log.exception("engine thread died")
            self._dead = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, EngineError(f"engine died: {e}"))

    def _next_commands(self) -> list[object]:
        """Commands to apply before the next step; blocks while there is nothing to do."""
        if not self.core.has_unfinished():
            cmds = [self._commands.get()]  # idle: sleep until a command arrives
        else:
            cmds = []
            stats = self.core.last_stats
            if stats is not None and stats.num_scheduled_tokens == 0:
                # Nothing ran last step (window_ms hold, or waiting on memory): wait a little.
                hold = self.core.scheduler.stats.hold_until_s
                wait_s = _IDLE_POLL_S if hold is None else max(0.0, hold - self.core.clock())
                try:
                    cmds.append(self._commands.get(timeout=wait_s))
                except queue.Empty:
                    pass
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmds: list[object]) -> bool:
        """Apply commands in order; False on the stop command."""
        failed: list[tuple[str, BaseException]] = []
        for cmd in cmds:
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Abort):
                self.core.abort(cmd.request_id)
                self._in_engine.discard(cmd.request_id)
                continue
            assert isinstance(cmd, _Add)
            try:
                ok = self.core.add_request(
                    cmd.request_id,
                    cmd.prompt_token_ids,
                    cmd.params,
                    prompt=cmd.prompt,
                    priority=cmd.priority,
                    session_id=cmd.session_id,
                    timeout_s=cmd.timeout_s,
                    queue_timeout_s=cmd.queue_timeout_s,
                    delta=True,
                )
            except ValueError as e:
                failed.append((cmd.request_id, e))
                continue
            if ok:
                self._in_engine.add(cmd.request_id)
            else:
                failed.append((cmd.request_id, QueueFullError("the waiting queue is full")))
        self._post(failed)
        return True

    def _on_step_error(self, error: Exception) -> None:
        log.exception("engine step failed; failing every request in flight")
        self.num_step_errors += 1
        err = EngineError(f"the engine failed: {type(error).__name__}: {error}")
        failed: list[tuple[str, BaseException]] = []
        for request_id in sorted(self._in_engine):
            self.core.abort(request_id, RequestStatus.FINISHED_ERROR)
            failed.append((request_id, err))
        self._in_engine.clear()
        self._post(failed)
