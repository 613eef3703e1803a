"""EngineLoop: commands in, EngineCore steps, one StepOutputs per step out; in a thread or in the engine process."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidal.engine.messages import (
    AbortRequest,
    AddRequest,
    RequestFailure,
    Shutdown,
    StepOutputs,
    ToEngine,
)
from tidal.executor.errors import GroupLost
from tidal.loader.heap import release_free_heap
from tidal.request import RequestStatus

if TYPE_CHECKING:
    from tidal.engine.core import EngineCore

log = logging.getLogger(__name__)

# When requests exist but a step scheduled nothing (and the scheduler named no hold time), wait
# this long for a command before stepping again, so a stalled batch never spins a core.
_IDLE_POLL_S = 0.002


class EngineLoop:
    """The one engine loop: `put` commands from any thread; `run` applies them and steps.

    Before each step the loop drains the command queue (AddRequest, AbortRequest, Shutdown);
    while nothing is in flight it blocks on it. Every step that produced outputs or ran tokens
    is handed to `send` as one StepOutputs, from the loop's own thread: the engine process
    pickles it onto the pipe, the in-thread client hands it to its event loop. A step that raises
    fails every request in the engine (RequestFailure kind "engine"), frees their KV, and the
    loop carries on serving new requests. Only `run` touches the core.
    """

    def __init__(
        self,
        core: EngineCore,
        send: Callable[[StepOutputs], None],
        *,
        hang_when_waiting: int | None = None,
    ) -> None:
        self.core = core
        self.send = send
        # Fault injection (engine/process.py's TIDAL_ENGINE_FAULT): hang once this many wait.
        self.hang_when_waiting = hang_when_waiting
        self.num_steps = 0  # steps that ran; the heartbeat reports it (progress for the watchdog)
        self.num_step_errors = 0
        self._commands: queue.SimpleQueue[ToEngine] = queue.SimpleQueue()
        self._in_engine: set[str] = set()  # ids added and not yet finished

    def put(self, cmd: ToEngine) -> None:
        """Queue a command for the loop (thread-safe); it applies before the next step."""
        self._commands.put(cmd)

    def run(self) -> None:
        """Apply commands and step until Shutdown."""
        core = self.core
        while True:
            cmds = self._next_commands()
            failures, stop = self._apply(cmds)
            if stop:
                return
            if failures:
                self.send(StepOutputs(failures=failures, num_steps=self.num_steps))
            if not core.has_unfinished():
                if cmds:  # e.g. the last request was aborted: publish idle stats (KV freed)
                    self._went_idle()
                continue
            self._maybe_hang()
            try:
                outputs = core.step()
            except GroupLost:
                raise  # a tensor-parallel rank is gone: this engine ends, the supervisor restarts it
            except Exception as e:
                self._fail_all(e)
                continue
            self.num_steps += 1
            for out in outputs:
                if out.finished:
                    self._in_engine.discard(out.request_id)
            if outputs or core.last_stats.num_scheduled_tokens:
                self.send(StepOutputs(outputs, [], core.last_stats, self.num_steps))  # type: ignore[arg-type]
            if outputs and not core.has_unfinished():
                self._went_idle()

    def _went_idle(self) -> None:
        """Publish idle stats (0 running, KV freed) now, then hand the C heap's free pages back:
        a burst's step temporaries (each 1024-token step's activations and decoded weights) stay
        resident in glibc's arenas otherwise: after 8 concurrent ~1000-token prompts the engine's
        heap read 169 MiB without this, 93 MiB with it. malloc_trim takes a few milliseconds, and
        only when nothing is left to run; the peak during a burst is unchanged."""
        core = self.core
        core.step()
        self.send(StepOutputs(stats=core.last_stats, num_steps=self.num_steps))
        release_free_heap()

    def _next_commands(self) -> list[ToEngine]:
        """Commands to apply before the next step; blocks while there is nothing to do."""
        core = self.core
        cmds: list[ToEngine] = []
        if not core.has_unfinished():
            cmds.append(self._commands.get())  # idle: sleep until a command arrives
        else:
            stats = core.last_stats
            if stats is not None and stats.num_scheduled_tokens == 0:
                # Nothing ran last step (window_ms hold, or waiting on memory): wait a little.
                hold = core.scheduler.stats.hold_until_s
                wait_s = _IDLE_POLL_S if hold is None else max(0.0, hold - core.clock())
                try:
                    cmds.append(self._commands.get(timeout=wait_s))
                except queue.Empty:
                    pass
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmds: list[ToEngine]) -> tuple[list[RequestFailure], bool]:
        """Apply commands in order: the refused requests, and True on Shutdown."""
        failures: list[RequestFailure] = []
        for cmd in cmds:
            if isinstance(cmd, Shutdown):
                return failures, True
            if isinstance(cmd, AbortRequest):
                self.core.abort(cmd.request_id)
                self._in_engine.discard(cmd.request_id)
                continue
            if not isinstance(cmd, AddRequest):
                log.error("unknown command %r ignored", type(cmd).__name__)
                continue
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
                failures.append(RequestFailure(cmd.request_id, "invalid", str(e)))
                continue
            if ok:
                self._in_engine.add(cmd.request_id)
            else:
                failures.append(
                    RequestFailure(cmd.request_id, "queue_full", "the waiting queue is full")
                )
        return failures, False

    def _maybe_hang(self) -> None:
        stats = self.core.last_stats
        n = self.hang_when_waiting
        if n is not None and stats is not None and stats.num_waiting >= n and stats.num_running:
            log.warning("fault injection: the step loop hangs now (%d waiting)", stats.num_waiting)
            threading.Event().wait()

    def _fail_all(self, error: Exception) -> None:
        """A step raised: fail every request in the engine, free their KV, keep serving."""
        log.exception("engine step failed; failing every request in flight")
        self.num_step_errors += 1
        message = f"the engine failed: {type(error).__name__}: {error}"
        failures = []
        for request_id in sorted(self._in_engine):
            self.core.abort(request_id, RequestStatus.FINISHED_ERROR)
            failures.append(RequestFailure(request_id, "engine", message))
        self._in_engine.clear()
        self.send(StepOutputs(failures=failures, num_steps=self.num_steps))
