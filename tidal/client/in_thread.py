"""InThreadEngineClient: the EngineClient whose engine loop runs on a thread of this process."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from tidal.client.engine_client import EngineClient
from tidal.engine.errors import EngineError
from tidal.engine.loop import EngineLoop
from tidal.engine.messages import Shutdown, StepOutputs, ToEngine

if TYPE_CHECKING:
    from tidal.engine.core import EngineCore

log = logging.getLogger(__name__)


class InThreadEngineClient(EngineClient):
    """The engine (`server.engine_process: false`) on one thread, behind the EngineClient interface.

    Threads: the event loop only puts commands on the EngineLoop's thread-safe queue; the
    engine thread runs the loop (torch releases the GIL during a step) and hands each
    StepOutputs back with one `call_soon_threadsafe` to `engine_message`, the same output
    handler the supervised engine's messages reach. If the loop itself dies (an abort that
    failed), every request in flight fails with EngineError and `alive` turns False.
    """

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.core = core
        self.tokenizer = core.tokenizer
        self.loop = EngineLoop(core, self._post)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None

    @property
    def num_step_errors(self) -> int:
        return self.loop.num_step_errors

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        self._thread.start()
        if self.on_up is not None:
            self.on_up(True)

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still in flight fail with EngineError."""
        thread = self._thread
        if thread is None:
            return
        self.loop.put(Shutdown())
        await asyncio.to_thread(thread.join)
        self._thread = None
        self._fail_all(EngineError("the engine is shut down"), reason=None)
        if self.on_up is not None:
            self.on_up(False)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def _send(self, cmd: ToEngine) -> None:
        self.loop.put(cmd)

    def _post(self, msg: StepOutputs) -> None:
        """The loop's `send`, on the engine thread: hand the message to the event loop."""
        loop = self._event_loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.engine_message, msg)

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:  # an abort that itself failed: the engine is unusable
            log.exception("engine thread died")
            self._dead = e
            loop = self._event_loop
            if loop is not None and not loop.is_closed():
                error = EngineError(f"engine died: {e}")
                loop.call_soon_threadsafe(self._fail_all, error, "engine_died")
