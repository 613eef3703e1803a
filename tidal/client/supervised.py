"""SupervisedEngineClient: the EngineClient whose engine loop runs in a supervised process, restarted when it dies or hangs."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from tidal.client.engine_client import EngineClient, EngineInterrupted
from tidal.config.engine import EngineConfig
from tidal.engine.errors import EngineError
from tidal.engine.messages import EngineReady, ToEngine
from tidal.engine.process import FAULT_ENV
from tidal.supervisor.handle import EngineStartError
from tidal.supervisor.restart_policy import RestartPolicy
from tidal.supervisor.supervisor import Supervisor

log = logging.getLogger(__name__)

# Starting an engine process costs more than loading the model: the interpreter, torch's import
# and warm-up. Added to the load time for a restart estimate before one has been measured.
_SPAWN_OVERHEAD_S = 2.0


class SupervisedEngineClient(EngineClient):
    """The engine in a child process, behind the EngineClient interface; this process needs no torch.

    When the engine dies or hangs, `alive` turns False at once; requests that already produced
    output fail with EngineInterrupted (counted under reason "engine_died" / "engine_hung");
    requests that produced nothing stay queued here and are sent again to the restarted engine.
    When the restart budget is spent every request fails ("engine_gave_up") and `on_fatal` runs.
    A request the engine itself fails (a step raised) ends with a plain EngineError
    ("engine_error").
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
        standby: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock)
        # Resolve the checkpoint once here: the bundled model may be assembled on first use,
        # and the engine process must not race the API process (or itself, after a restart).
        path = _model_path(config)
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
            standby=standby,
            fault_spec=fault_spec,
            log_level=log_level,
            clock=clock,
        )
        self.info: EngineReady | None = None
        self._started = False
        self._closed = False
        self._down_at: float | None = None  # clock time the engine last went down
        self.last_restart_s: float | None = None  # down -> up of the last restart, measured
        self._measured_restart_s: dict[bool, float] = {}  # the last, by whether from a standby
        # Called once the engine went down and its started requests failed; the requests kept
        # for the restarted engine may be taken elsewhere then (`take_unstarted`).
        self.on_down: Callable[[], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def launch(self) -> EngineReady:
        """Start the engine process and load the tokenizer here meanwhile; blocks until ready.

        Raises ValueError for a setting the engine rejected, EngineError if it failed otherwise.
        """
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1) as pool:
            engine = pool.submit(self.supervisor.launch)
            self.tokenizer = load_api_tokenizer(self.model_path)
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

    @property
    def fatal(self) -> str | None:
        """Why the supervisor gave up, or None."""
        return self.supervisor.fatal

    def restart_estimate_s(self) -> float:
        """How long until a restarted engine serves. With a live standby (the next restart takes
        it at once): the last restart from a standby as measured (down to up), else the first
        engine's load time. Without one: the last cold restart as measured, else the coming
        backoff plus the load time and the spawn overhead."""
        from_standby = self.supervisor.standby_live()
        measured = self._measured_restart_s.get(from_standby)
        if measured is not None:
            return measured
        load_s = self.info.load_time_s if self.info is not None else 0.0
        if from_standby:
            return load_s
        budget = self.supervisor.budget
        p = budget.policy
        backoff_s = min(p.backoff_max_s, p.backoff_initial_s * 2**budget.num_recent)
        return backoff_s + load_s + _SPAWN_OVERHEAD_S

    def _check_can_generate(self) -> None:
        # While the engine restarts a new request waits here and runs on the new engine.
        if self.fatal is not None:
            raise EngineInterrupted(self.fatal, "gave_up", None)
        if not self._started or self._closed:
            raise EngineError("the engine is not running")

    def _send(self, cmd: ToEngine) -> None:
        self.supervisor.send(cmd)  # while the engine is down, engine_up sends pending adds

    # ---- EngineListener (the supervisor calls these on the event loop) -------------------------
    # engine_message (the output handler) is EngineClient's.

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
                stream.queue.put_nowait((stream.tag, error))
                self._count_failed(f"engine_{reason}")
                failed += 1
            else:
                kept += 1
        log.warning(
            "engine down: %d started requests failed, %d kept for the new engine", failed, kept
        )
        if self.on_down is not None:
            self.on_down()

    def engine_up(self, ready: EngineReady, restarted: bool) -> None:
        self.info = ready
        if restarted and self._down_at is not None:
            self.last_restart_s = self._clock() - self._down_at
            self._measured_restart_s[self.supervisor.last_from_standby] = self.last_restart_s
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


def _model_path(config: EngineConfig) -> str:
    """The checkpoint path, the bundled model's when none is set (without importing torch)."""
    if config.model.path is not None:
        return config.model.path
    from tidal.loader.bundled import bundled_model_path

    return str(bundled_model_path())


def load_api_tokenizer(model_path: str):  # -> tidal.loader.tokenizer.Tokenizer
    """The tokenizer and chat template the API process needs, read without torch: the compact
    one where it encodes and decodes exactly as the full one (tidal.loader.token_encoder)."""
    from tidal.loader.arch_reader import read_arch_config
    from tidal.loader.token_encoder import load_compact_tokenizer

    return load_compact_tokenizer(model_path, read_arch_config(model_path).family)
