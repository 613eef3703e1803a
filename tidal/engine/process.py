"""The engine process: build the EngineCore from an EngineConfig, then run the EngineLoop over the pipe.

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
import sys
import threading
import time
from multiprocessing.connection import Connection

from tidal.config.engine import EngineConfig
from tidal.engine.loop import EngineLoop
from tidal.engine.messages import EngineFailed, EngineReady, Heartbeat

log = logging.getLogger(__name__)

FAULT_ENV = "TIDAL_ENGINE_FAULT"
FAULT_EXIT_CODE = 70
GROUP_LOST_EXIT_CODE = 71  # a tensor-parallel rank died or a collective failed
HEARTBEAT_INTERVAL_S = 0.5
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
        # The API process tokenizes; this process only decodes.
        core = build_engine(
            config, progress=log.info, on_group_lost=_group_lost, decode_only=True,
            huge_pages_later=True,
        )  # fmt: skip
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
    # Ready: now the LM head may move into huge pages (~0.25-0.5 s of copying and page
    # assembly, at the lowest priority; the pointers stay, so steps run on meanwhile).
    from tidal.loader.resident import promote_in_background

    promote_in_background()
    hang_waiting = int(fault.split("=")[1]) if fault and fault.startswith("hang_") else None
    _PipeEngine(core, conn, hang_waiting).run()


def _group_lost(reason: str) -> None:
    """A tensor-parallel rank is gone: end this process now, so the supervisor fails the
    started requests (retryable) and restarts the whole group."""
    log.error("tensor-parallel group lost (%s); the engine process exits", reason)
    logging.shutdown()
    os._exit(GROUP_LOST_EXIT_CODE)


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

    # Two prompt tokens (the tokenizer here may only decode): BOS when the model has one.
    bos = core.tokenizer.bos_token_id
    ids = [0 if bos is None else bos, 0][: max(1, core.max_model_len - 8)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=1)
    core.add_request("warmup-0", ids, params)
    while core.has_unfinished():
        core.step()
    core.step()  # publish idle stats


class _PipeEngine:
    """The EngineLoop on the pipe: a reader thread puts commands in, each StepOutputs is sent
    back, and a heartbeat thread beats ~every 0.5 s."""

    def __init__(self, core, conn: Connection, hang_when_waiting: int | None) -> None:
        self.core = core  # tidal.engine.core.EngineCore
        self.conn = conn
        self._send_lock = threading.Lock()  # the heartbeat thread and the loop share the pipe
        self.loop = EngineLoop(core, self.send, hang_when_waiting=hang_when_waiting)

    def send(self, msg: object) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def run(self) -> None:
        threading.Thread(target=self._receive, name="tidal-engine-recv", daemon=True).start()
        threading.Thread(target=self._beat, name="tidal-engine-beat", daemon=True).start()
        self.loop.run()

    def _receive(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                # The API process is gone: nobody can read our outputs, so stop at once.
                os._exit(0)
            self.loop.put(msg)

    def _beat(self) -> None:
        stopped = threading.Event()
        while not stopped.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.send(Heartbeat(self.loop.num_steps, self.core.num_unfinished))
            except OSError:
                return
