"""EngineHandle: one spawned engine process, its pipe, and the threads that write to and read from it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from tidal.config.engine import EngineConfig
from tidal.engine.messages import EngineFailed, EngineReady
from tidal.engine.process import run_engine_process
from tidal.supervisor.child_process import ChildProcess
from tidal.supervisor.standby import StartEngine, run_standby_process

log = logging.getLogger(__name__)

_CLOSE = object()


class EngineStartError(RuntimeError):
    """The engine process failed before reporting ready; kind "config" is a bad setting."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class EngineHandle:
    """Runs `run_engine_process` in a fresh Python process (tidal.supervisor.child_process; never
    a fork: torch threads).

    The API process never blocks on the pipe: a writer thread sends commands (a hung engine
    stops reading and a full pipe would otherwise stall the event loop) and a reader thread
    receives messages and hands them to `on_message`; `on_lost` runs once the pipe closes,
    which is the moment the process dies.
    """

    def __init__(
        self,
        config: EngineConfig,
        incarnation: int | None,
        *,
        warmup: bool = False,
        fault: str | None = None,
        log_level: int = logging.INFO,
    ) -> None:
        """Spawn an engine process; incarnation None spawns a standby (see `activate`)."""
        self.incarnation = incarnation
        kwargs = dict(config=config, log_level=log_level, spawned_at=time.time())
        if incarnation is None:
            target = run_standby_process
        else:
            target = run_engine_process
            kwargs.update(incarnation=incarnation, warmup=warmup, fault=fault)
        self.process = ChildProcess(target, kwargs)  # killed when the API process exits
        self.conn = self.process.conn
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()

    @property
    def is_standby(self) -> bool:
        return self.incarnation is None

    def activate(self, incarnation: int, warmup: bool, fault: str | None) -> bool:
        """Tell a standby process to start as `incarnation`; False if it is already gone."""
        if not self.is_standby:
            raise ValueError(
                f"activate() needs a standby handle, not incarnation {self.incarnation}"
            )
        if not self.process.is_alive():
            return False
        try:
            self.conn.send(StartEngine(incarnation, warmup, fault))
        except (OSError, ValueError):  # it died after the check
            return False
        self.incarnation = incarnation
        return True

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def wait_ready(self, timeout_s: float) -> EngineReady:
        """Block until the engine reports ready; EngineStartError if it fails, dies or takes too long."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise EngineStartError("error", f"the engine did not start within {timeout_s:g} s")
            ready = wait([self.conn, self.process.sentinel], timeout=left)
            if self.conn in ready:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    self.process.join(timeout=10)
                    raise EngineStartError(msg.kind, msg.message)
                if msg is not None:
                    continue
            if not self.process.is_alive() or self.conn in ready:
                self.process.join(timeout=10)
                raise EngineStartError(
                    "error", f"the engine process died while starting ({exit_text(self.exitcode)})"
                )

    def start_io(self, on_message: Callable[[object], None], on_lost: Callable[[], None]) -> None:
        """Start the reader and writer threads (call once, after wait_ready)."""

        def read() -> None:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    self._outbox.put(_CLOSE)
                    on_lost()
                    return
                on_message(msg)

        def write() -> None:
            while True:
                msg = self._outbox.get()
                if msg is _CLOSE:
                    return
                try:
                    self.conn.send(msg)
                except (OSError, ValueError):  # the engine is gone; the reader reports it
                    return

        name = f"tidal-engine-{self.incarnation}"
        threading.Thread(target=read, name=name + "-read", daemon=True).start()
        threading.Thread(target=write, name=name + "-write", daemon=True).start()

    def send(self, msg: object) -> None:
        """Queue a command for the engine (never blocks)."""
        self._outbox.put(msg)

    def join(self, timeout_s: float) -> bool:
        """Wait for the process to exit on its own; True if it did."""
        self.process.join(timeout=timeout_s)
        return not self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL the process (a hung engine ignores politer signals) and reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=30)
        self._outbox.put(_CLOSE)
