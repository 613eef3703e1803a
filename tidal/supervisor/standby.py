"""The standby engine process: imports torch and tidal ahead of time, then waits to become the engine.

A cold engine process spends seconds starting Python and importing torch before it reads a
single weight. The supervisor spawns the next engine process as soon as the current one is
ready; it does those imports and then blocks on its pipe holding no weights, no KV cache and
no threads, until the supervisor sends `StartEngine` (the current engine died or hung) or
closes the pipe (the server stops: it exits).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tidal.config.engine import EngineConfig
from tidal.engine.messages import Shutdown
from tidal.engine.process import run_engine_process, setup_logging

log = logging.getLogger(__name__)

_NICE = 10  # added to the import thread's nice value


@dataclass(slots=True)
class StartEngine:
    """Supervisor -> standby process: load the model and serve as `incarnation` now."""

    incarnation: int
    warmup: bool
    fault: str | None


def run_standby_process(
    config: EngineConfig, conn: Connection, log_level: int, spawned_at: float
) -> None:
    """The standby process's entry point (top-level, so "spawn" can import it)."""
    entered_at = time.time()
    setup_logging(log_level)
    # The imports run in a thread at a lower CPU priority (Linux nice values are per thread),
    # so a standby never competes with the serving engine for a core; the main thread, which
    # becomes the engine, keeps the normal priority (an unprivileged process could not raise it
    # back). A StartEngine that arrives meanwhile waits in the pipe until they finish.
    worker = threading.Thread(target=_preimport, args=(config,), name="tidal-standby-import")
    worker.start()
    worker.join()
    log.info(
        "standby engine process %d ready (spawn %.2f s, import %.2f s)",
        os.getpid(),
        max(0.0, entered_at - spawned_at),
        time.time() - entered_at,
    )
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return  # the API process is gone or stopped us
    if isinstance(msg, Shutdown):
        return
    if not isinstance(msg, StartEngine):
        log.error("standby got %r instead of StartEngine; exiting", type(msg).__name__)
        return
    run_engine_process(config, conn, msg.incarnation, msg.warmup, msg.fault, log_level)


def _preimport(config: EngineConfig) -> None:
    """Import what building an engine imports (torch, the engine, the loader and the model's
    module) and read the checkpoint's header, without reading any weights. Failures here are
    left for the real start to report."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not Linux
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _NICE)
    try:
        import safetensors.torch  # noqa: F401  (the weight cache reader)

        import tidal.engine.builder  # noqa: F401  (torch, EngineCore)
        import tidal.loader.token_decoder  # noqa: F401
        import tidal.loader.tokenizer  # noqa: F401
        from tidal.engine.builder import model_path
        from tidal.loader.model_loader import build_on_meta, read_arch

        arch = read_arch(model_path(config))[0]  # memoized: the real start reuses it
        # The model's modules on the meta device, as the loader builds them (imports what that
        # imports, nothing more: an init on meta would pull in torch._dynamo and sympy).
        build_on_meta(arch)
        # The native kernels: built once per machine, loaded once per process.
        from tidal.kernels import argmax, gguf_gemm, paged_attention

        gguf_gemm.available()
        paged_attention.available()
        argmax.available()
    except Exception as e:  # e.g. a model file that is missing now: the start will say so
        log.warning("standby could not pre-import everything: %s: %s", type(e).__name__, e)
