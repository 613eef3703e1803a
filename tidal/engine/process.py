"""The engine process: build the EngineCore from an EngineConfig, then apply commands, step and send outputs.

Fault injection (tests only, off by default): the API process reads `TIDAL_ENGINE_FAULT` and hands
each engine process the action meant for its incarnation (0 is the first engine, 1 the first
restart, ...). The variable is a comma-separated list of `<incarnation>:<action>` rules, the first
match wins, `*` matches every incarnation. Actions:

- `hang_when_waiting=N`: once a step leaves at least N requests waiting and one running, the step
  loop blocks forever (the heartbeat thread keeps beating, so only the watchdog can tell).
- `exit_when_ready`: exit with code 70 right after reporting ready.
- `exit_on_start`: exit with code 70 before loading anything.

Example: `TIDAL_ENGINE_FAULT="0:hang_when_waiting=2"` hangs the first engine only.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from multiprocessing.connection import Connection

from tidal.config.engine import EngineConfig
from tidal.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    Heartbeat,
    RequestFailure,
    Shutdown,
    StepOutputs,
)

log = logging.getLogger(__name__)

FAULT_ENV = "TIDAL_ENGINE_FAULT"
FAULT_EXIT_CODE = 70
HEARTBEAT_INTERVAL_S = 0.5
# When requests exist but a step scheduled nothing (and the scheduler named no hold time), wait
# this long for a command before stepping again, so a stalled batch never spins a core.
_IDLE_POLL_S = 0.002
_FAULT_ACTIONS = ("hang_when_waiting", "exit_when_ready", "exit_on_start")


def fault_for(spec: str | None, incarnation: int) -> str | None:
    """The fault action `spec` (TIDAL_ENGINE_FAULT's grammar) sets for one incarnation, or None."""
    if not spec:
        return None
    for rule in spec.split(","):
        who, sep, action = rule.strip().partition(":")
        name, _, arg = action.partition("=")
        if not sep or name not in _FAULT_ACTIONS or (name == "hang_when_waiting") != arg.isdigit():
            raise ValueError(
                f"{FAULT_ENV}={spec!r} is invalid: expected rules like '0:hang_when_waiting=2' "
                f"with an action in {_FAULT_ACTIONS}"
            )
        if who == "*" or (who.isdigit() and int(who) == incarnation):
            return action
    return None


def run_engine_process(
    config: EngineConfig,
    conn: Connection,
    incarnation: int,
    warmup: bool,
    fault: str | None,
    log_level: int = logging.INFO,
    spawned_at: float | None = None,
) -> None:
    """The engine process's entry point (a top-level function, so "spawn" can import it).

    `spawned_at` is the parent's `time.time()` when it spawned this process; it lets the phase
    log line below tell the interpreter's own start-up apart from ours. A standby process
    (tidal.supervisor.standby) calls this with None once it is told to start.
    """
    entered_at = time.time()
    setup_logging(log_level)
    if fault == "exit_on_start":
        os._exit(FAULT_EXIT_CODE)
    from tidal.engine.builder import build_engine

    phases = _Phases(entered_at)
    phases.mark("import")
    try:
        core = build_engine(config, progress=log.info)
        phases.mark("build")
        if warmup:
            _warm_up(core)
            phases.mark("warmup")
    except ValueError as e:  # a setting only the loaded model can find wrong
        conn.send(EngineFailed("config", str(e)))
        sys.exit(2)
    except Exception as e:
        log.exception("the engine failed to start")
        conn.send(EngineFailed("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    device = core.loaded.device
    device_memory = None
    if device.type == "cuda":
        import torch

        device_memory = torch.cuda.get_device_properties(device).total_memory
    conn.send(
        EngineReady(
            pid=os.getpid(),
            incarnation=incarnation,
            max_model_len=core.max_model_len,
            vocab_size=core.loaded.arch.vocab_size,
            num_blocks=core.num_blocks,
            load_time_s=core.loaded.load_time_s,
            device_type=device.type,
            device_memory_bytes=device_memory,
        )
    )
    spawn_s = None if spawned_at is None else max(0.0, entered_at - spawned_at)
    log.info(
        "engine phases (incarnation %d%s): %s (model load %.2f s inside build)",
        incarnation,
        "" if spawned_at is not None else ", from a standby process",
        phases.text(spawn_s),
        core.loaded.load_time_s,
    )
    if fault == "exit_when_ready":
        os._exit(FAULT_EXIT_CODE)
    hang_waiting = int(fault.split("=")[1]) if fault and fault.startswith("hang_") else None
    _EngineLoop(core, conn, hang_waiting).run()


def setup_logging(log_level: int) -> None:
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )


class _Phases:
    """Wall time of each start-up phase, for one log line (scripts/measure_restart.py reads it)."""

    def __init__(self, start: float) -> None:
        self._last = start
        self._spans: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self._spans.append((name, now - self._last))
        self._last = now

    def text(self, spawn_s: float | None) -> str:
        spans = ([] if spawn_s is None else [("spawn", spawn_s)]) + self._spans
        return ", ".join(f"{name} {span_s:.2f} s" for name, span_s in spans)


def _warm_up(core) -> None:  # core: EngineCore
    """One short greedy request straight on the core (a prefill step and a decode step, the two
    code paths serving takes), so a restarted engine is warm when ready. Kept this short
    because it is on the kill-to-ready path: its cost is mostly first-touching the weights."""
    from tidal.sampling_params import SamplingParams

    ids = core.tokenizer.encode("Hello")[: max(1, core.max_model_len - 8)] or [0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=1)
    core.add_request("warmup-0", ids, params)
    while core.has_unfinished():
        core.step()
    core.step()  # publish idle stats


class _EngineLoop:
    """Commands in (a reader thread), steps, one StepOutputs per step out, a heartbeat thread."""

    def __init__(self, core, conn: Connection, hang_when_waiting: int | None) -> None:
        self.core = core  # tidal.engine.core.EngineCore
        self.conn = conn
        self.hang_when_waiting = hang_when_waiting
        self.num_steps = 0
        self._send_lock = threading.Lock()  # the heartbeat thread and the loop share the pipe
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._in_engine: set[str] = set()  # ids added and not yet finished

    def send(self, msg: object) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def run(self) -> None:
        threading.Thread(target=self._receive, name="tidal-engine-recv", daemon=True).start()
        threading.Thread(target=self._beat, name="tidal-engine-beat", daemon=True).start()
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
                    core.step()
                    self.send(StepOutputs(stats=core.last_stats, num_steps=self.num_steps))
                continue
            self._maybe_hang()
            try:
                outputs = core.step()
            except Exception as e:
                self._fail_all(e)
                continue
            self.num_steps += 1
            for out in outputs:
                if out.finished:
                    self._in_engine.discard(out.request_id)
            if outputs or core.last_stats.num_scheduled_tokens:
                self.send(StepOutputs(outputs, [], core.last_stats, self.num_steps))
            if outputs and not core.has_unfinished():
                core.step()  # publish idle stats (0 running, KV freed) now
                self.send(StepOutputs(stats=core.last_stats, num_steps=self.num_steps))

    def _maybe_hang(self) -> None:
        stats = self.core.last_stats
        n = self.hang_when_waiting
        if n is not None and stats is not None and stats.num_waiting >= n and stats.num_running:
            log.warning("fault injection: the step loop hangs now (%d waiting)", stats.num_waiting)
            threading.Event().wait()

    def _receive(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                # The API process is gone: nobody can read our outputs, so stop at once.
                os._exit(0)
            self._commands.put(msg)

    def _beat(self) -> None:
        stopped = threading.Event()
        while not stopped.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.send(Heartbeat(self.num_steps, self.core.num_unfinished))
            except OSError:
                return

    def _next_commands(self) -> list[object]:
        """Commands to apply before the next step; blocks while there is nothing to do."""
        core = self.core
        cmds: list[object] = []
        if not core.has_unfinished():
            cmds.append(self._commands.get())  # idle: sleep until a command arrives
        else:
            stats = core.last_stats
            if stats is not None and stats.num_scheduled_tokens == 0:
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

    def _apply(self, cmds: list[object]) -> tuple[list[RequestFailure], bool]:
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

    def _fail_all(self, error: Exception) -> None:
        """A step raised: fail every request in the engine, free their KV, keep serving."""
        from tidal.request import RequestStatus

        log.exception("engine step failed; failing every request in flight")
        message = f"the engine failed: {type(error).__name__}: {error}"
        failures = []
        for request_id in sorted(self._in_engine):
            self.core.abort(request_id, RequestStatus.FINISHED_ERROR)
            failures.append(RequestFailure(request_id, "engine", message))
        self._in_engine.clear()
        self.send(StepOutputs(failures=failures, num_steps=self.num_steps))
