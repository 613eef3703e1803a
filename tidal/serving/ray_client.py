"""RayEngineClient: the EngineClient whose engines are Ray Serve replicas, reached through a deployment handle."""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from tidal.client.engine_client import EngineClient, EngineInterrupted
from tidal.engine.errors import EngineError, QueueFullError
from tidal.engine.messages import AbortRequest, AddRequest, StepOutputs, ToEngine

log = logging.getLogger(__name__)

# A replica lost before any output reached the caller: the request runs again on another one
# (the handle's router no longer offers the dead replica once Serve noticed), this many times.
_MAX_ATTEMPTS = 3
_RETRY_AFTER_S = 5.0  # a lost replica is replaced by Serve's controller within seconds
_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)


class RayEngineClient(EngineClient):
    """The server's engine client on the Ray Serve ingress replica.

    Each AddRequest becomes one streaming call `engine.generate(add)` on the engine deployment;
    its custom request router (serving/ray_router.py) picks the replica from the AddRequest's
    session and prompt. Every RequestDelta the call yields goes through `engine_message`, the
    one output handler, exactly as the supervised engine's do. An abort cancels the call (the
    replica then aborts the request). A replica that dies fails the requests it had started
    with EngineInterrupted ("died": retry) and reruns the ones that had not.
    """

    def __init__(self, handle) -> None:  # handle: ray.serve.handle.DeploymentHandle
        super().__init__()
        self.handle = handle.options(stream=True)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def shutdown(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all(EngineError("the engine is shut down"), reason=None)

    @property
    def alive(self) -> bool:
        return self._loop is not None and not self._closed

    def _send(self, cmd: ToEngine) -> None:
        if isinstance(cmd, AddRequest):
            assert self._loop is not None  # start() ran: submit checks `alive`
            self._tasks[cmd.request_id] = self._loop.create_task(self._run(cmd))
        elif isinstance(cmd, AbortRequest):
            task = self._tasks.pop(cmd.request_id, None)
            if task is not None:
                task.cancel()

    async def _run(self, add: AddRequest) -> None:
        request_id = add.request_id
        try:
            for attempt in range(1, _MAX_ATTEMPTS + 1):
                try:
                    async for delta in self.handle.generate.remote(add):
                        self.engine_message(StepOutputs(outputs=[delta]))
                    return
                except _LOST as e:
                    stream = self._streams.get(request_id)
                    if stream is None:
                        return
                    if stream.started or attempt == _MAX_ATTEMPTS:
                        del self._streams[request_id]
                        stream.queue.put_nowait(
                            (
                                stream.tag,
                                EngineInterrupted(
                                    f"the engine replica died: {e}", "died", _RETRY_AFTER_S
                                ),
                            )
                        )
                        self._count_failed("engine_died")
                        return
                    log.warning(
                        "engine replica lost before %s started; running it again", request_id
                    )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine refused or failed it: the original error type
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.queue.put_nowait((stream.tag, _engine_error(e)))
        finally:
            self._tasks.pop(request_id, None)


def _engine_error(e: BaseException) -> BaseException:
    """The exception the server maps to a status: Ray re-raises a replica's error as a
    RayTaskError that is also an instance of the original class."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, QueueFullError | ValueError | EngineError):
        return cause
    return EngineError(f"the engine replica failed: {cause}")
