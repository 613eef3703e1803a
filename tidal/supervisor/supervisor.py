"""Supervisor: keeps one engine process serving: watches it, restarts it with backoff, gives up on a spent budget."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tidal.config.engine import EngineConfig
from tidal.engine.messages import EngineReady, Heartbeat, Shutdown
from tidal.engine.process import fault_for
from tidal.supervisor.handle import EngineHandle, EngineStartError, exit_text
from tidal.supervisor.restart_policy import RestartBudget, RestartPolicy
from tidal.supervisor.watchdog import Watchdog

log = logging.getLogger(__name__)

# How often the watch task looks at the process sentinel and the watchdog. A death is usually
# seen sooner: the reader thread reports the pipe closing at once.
_TICK_S = 0.1
_START_TIMEOUT_S = 900.0  # a large model loading from a slow disk
# A standby that died while idle is replaced after this long (not at once: one that cannot
# even import would otherwise respawn every tick).
_STANDBY_RETRY_S = 30.0


class EngineListener(Protocol):
    """What the supervisor tells its client (all calls on the event loop)."""

    def engine_message(self, msg: object) -> None: ...
    def engine_down(self, reason: str, detail: str) -> None: ...
    def engine_up(self, ready: EngineReady, restarted: bool) -> None: ...
    def engine_fatal(self, detail: str) -> None: ...
    def has_work(self) -> bool: ...


class Supervisor:
    """Owns the current EngineHandle. Verdicts: "died" (the pipe closed or the process exited) and
    "hung" (the watchdog: work pending, no progress for `watchdog_timeout_s`). Either way the
    process is killed, the listener hears `engine_down` at once, and a new engine starts after
    the budget's backoff (at once from a live standby); when the budget is spent the listener
    hears `engine_fatal`.

    With a standby, a spare engine process (tidal.supervisor.standby) is spawned whenever none is
    waiting; it imports torch and tidal and then idles without weights, and a restart tells it to
    load instead of spawning a cold process (seconds of imports saved). `standby` True keeps one
    from the start, False never, None (the default) from the first restart on: a server whose
    engine never fails holds no spare (~0.24 GB), one that has failed once restarts fast next."""

    def __init__(
        self,
        config: EngineConfig,
        listener: EngineListener,
        *,
        policy: RestartPolicy | None = None,
        watchdog_timeout_s: float = 30.0,
        warmup_on_restart: bool = True,
        standby: bool | None = None,
        fault_spec: str | None = None,
        log_level: int = logging.INFO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        fault_for(fault_spec, 0)  # a malformed spec fails now, not in a child
        self.config = config
        self.listener = listener
        self.budget = RestartBudget(policy or RestartPolicy(), clock)
        self.watchdog = Watchdog(watchdog_timeout_s, clock)
        self.warmup_on_restart = warmup_on_restart
        self.use_standby = standby
        self.clock = clock
        self.fault_spec = fault_spec
        self.log_level = log_level
        self.up = False
        self.fatal: str | None = None
        self.num_restarts = 0
        self.last_from_standby = False  # whether the last restart took the standby
        self._handle: EngineHandle | None = None
        self._starting: EngineHandle | None = None  # a restart still loading (killed on stop)
        self._standby: EngineHandle | None = None  # a spare process waiting to be told to load
        self._standby_retry_at = float("-inf")
        self._lock = threading.Lock()
        self._incarnation = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._trouble: asyncio.Event | None = None
        self._stopping = False
        self._last_beat: Heartbeat | None = None

    @property
    def pid(self) -> int | None:
        return None if self._handle is None else self._handle.pid

    # ---- start and stop -----------------------------------------------------------------------

    def launch(self, timeout_s: float = _START_TIMEOUT_S) -> EngineReady:
        """Start the first engine and block until it is ready (before the event loop runs)."""
        handle, ready = self._spawn(0, warmup=False, timeout_s=timeout_s)
        self._handle = handle
        return ready

    def start(self) -> None:
        """Begin watching; call from the event loop that will receive the engine's messages."""
        if self._task is not None or self._handle is None:
            return
        self._loop = asyncio.get_running_loop()
        self._trouble = asyncio.Event()
        self._attach(self._handle)
        self._task = asyncio.create_task(self._watch(), name="tidal-supervisor")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to exit, kill it if it does not, and stop watching."""
        self._stopping = True
        self.up = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with self._lock:
            handles = [h for h in (self._handle, self._starting) if h is not None]
            standby, self._standby = self._standby, None
        if standby is not None:  # idle, holding nothing: no need to ask politely
            await asyncio.to_thread(standby.kill)
        for h in handles:
            h.send(Shutdown())
            if not await asyncio.to_thread(h.join, timeout_s):
                await asyncio.to_thread(h.kill)

    def send(self, msg: object) -> bool:
        """Send a command to the engine; False (nothing sent) while it is down."""
        if not self.up or self._handle is None:
            return False
        self._handle.send(msg)
        return True

    # ---- spawning -----------------------------------------------------------------------------

    def _spawn(
        self,
        incarnation: int,
        warmup: bool,
        timeout_s: float,
        standby: EngineHandle | None = None,
    ) -> tuple[EngineHandle, EngineReady]:
        """Start one engine process, from `standby` if it is still alive, and wait until it is
        ready (blocking; a worker thread)."""
        fault = fault_for(self.fault_spec, incarnation)
        handle = None
        if standby is not None:
            if standby.activate(incarnation, warmup, fault):
                handle = standby
            else:
                log.warning(
                    "standby engine process %s is gone (%s); spawning a cold one",
                    standby.pid,
                    exit_text(standby.exitcode),
                )
                standby.kill()
        if handle is None:
            handle = EngineHandle(
                self.config, incarnation, warmup=warmup, fault=fault, log_level=self.log_level
            )
        with self._lock:
            self._starting = handle
        log.info(
            "engine process %d starting (incarnation %d%s)",
            handle.pid,
            incarnation,
            ", from standby" if handle is standby else "",
        )
        try:
            ready = handle.wait_ready(timeout_s)
        finally:
            with self._lock:
                self._starting = None
        if self._stopping:
            handle.kill()
            raise EngineStartError("error", "the server is shutting down")
        log.info(
            "engine process %d ready (incarnation %d, load %.2f s)",
            handle.pid,
            incarnation,
            ready.load_time_s,
        )
        return handle, ready

    def _attach(self, handle: EngineHandle) -> None:
        loop = self._loop
        assert loop is not None and self._trouble is not None
        trouble = self._trouble

        # NOTE: the reader thread may outlive the loop (an engine killed while the server
        # exits); a closed loop raises RuntimeError and nobody is left to tell.
        def on_message(msg: object) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._on_message, handle, msg)

        def on_lost() -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._on_lost, handle)

        self.watchdog.reset()
        self._last_beat = None
        self.up = True
        trouble.clear()
        handle.start_io(on_message, on_lost)

    # ---- the event loop side ------------------------------------------------------------------

    def _on_message(self, handle: EngineHandle, msg: object) -> None:
        if handle is not self._handle or not self.up:
            return  # a message from an engine already declared down
        if isinstance(msg, Heartbeat):
            self.watchdog.progress(msg.num_steps)
            self._last_beat = msg
            return
        self.watchdog.progress()  # any output or failure is progress
        self.watchdog.progress(getattr(msg, "num_steps", None))
        self.listener.engine_message(msg)

    def _on_lost(self, handle: EngineHandle) -> None:
        if handle is self._handle and self.up and self._trouble is not None:
            self._down("died", "the engine process died")
            self._trouble.set()

    def _down(self, reason: str, detail: str) -> None:
        if self.up:
            self.up = False
            log.error("engine down (%s): %s", reason, detail)
            self.listener.engine_down(reason, detail)

    async def _watch(self) -> None:
        assert self._trouble is not None
        while True:
            handle = self._handle
            assert handle is not None
            reason, detail = await self._wait_for_failure(handle)
            self._down(reason, detail)
            await asyncio.to_thread(handle.kill)
            log.error(
                "engine process %s is gone (%s, %s)", handle.pid, reason, exit_text(handle.exitcode)
            )
            if not await self._restart():
                return

    def _wants_standby(self) -> bool:
        return self.use_standby is True or (self.use_standby is None and self.num_restarts > 0)

    async def _keep_standby(self) -> None:
        """Have a live standby process unless none is wanted (yet), we are stopping, or one died
        lately."""
        if not self._wants_standby() or self._stopping:
            return
        standby = self._standby
        if standby is not None:
            if standby.is_alive():
                return
            log.warning(
                "standby engine process %s died while idle (%s); replacing it in %g s",
                standby.pid,
                exit_text(standby.exitcode),
                _STANDBY_RETRY_S,
            )
            with self._lock:
                self._standby = None
            await asyncio.to_thread(standby.kill)  # reap it
            self._standby_retry_at = self.clock() + _STANDBY_RETRY_S
        if self.clock() < self._standby_retry_at:
            return
        standby = await asyncio.to_thread(EngineHandle, self.config, None, log_level=self.log_level)
        with self._lock:
            self._standby = standby
        log.info("standby engine process %d spawned", standby.pid)

    def standby_live(self) -> bool:
        """Whether a live standby is held: the next restart takes it, without the backoff."""
        with self._lock:
            standby = self._standby
        return standby is not None and standby.is_alive()

    def _take_standby(self) -> EngineHandle | None:
        with self._lock:
            standby, self._standby = self._standby, None
        return standby

    async def _wait_for_failure(self, handle: EngineHandle) -> tuple[str, str]:
        assert self._trouble is not None
        while True:
            await self._keep_standby()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._trouble.wait(), _TICK_S)
            if self._trouble.is_set() or not handle.is_alive():
                return "died", f"the engine process died ({exit_text(handle.exitcode)})"
            stalled_s = self.watchdog.stalled_s(self.listener.has_work())
            if stalled_s > self.watchdog.timeout_s:
                beat = self._last_beat
                steps = (
                    "no heartbeat yet"
                    if beat is None
                    else (
                        f"last heartbeat: step {beat.num_steps}, {beat.num_unfinished} unfinished"
                    )
                )
                return "hung", f"the engine made no progress for {stalled_s:.1f} s ({steps})"

    async def _restart(self) -> bool:
        """Start a new engine after the backoff; False when the restart budget is spent."""
        while True:
            delay_s = self.budget.next_delay_s()
            if delay_s is None:
                p = self.budget.policy
                self.fatal = (
                    f"the engine failed {p.max_restarts + 1} times within {p.window_s:g} s; "
                    "giving up"
                )
                log.critical(self.fatal)
                self.listener.engine_fatal(self.fatal)
                return False
            standby = self._take_standby()
            if standby is not None and standby.is_alive():
                # The backoff paces starts that may fail as the last one did; a live standby has
                # started already (its load can still fail: the next try then waits and goes cold).
                log.warning("restarting the engine from the standby now (cold: in %.2f s)", delay_s)
            else:
                log.warning("restarting the engine in %.2f s", delay_s)
                await asyncio.sleep(delay_s)
            self._incarnation += 1
            try:
                handle, ready = await asyncio.to_thread(
                    self._spawn,
                    self._incarnation,
                    self.warmup_on_restart,
                    _START_TIMEOUT_S,
                    standby,
                )
            except EngineStartError as e:
                log.error("engine restart failed: %s", e)
                continue
            self._handle = handle
            self.num_restarts += 1
            self.last_from_standby = handle is standby
            self._attach(handle)
            self.listener.engine_up(ready, restarted=True)
            return True
