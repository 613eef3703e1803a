"""A failed warm-up is retried with backoff: /ready turns 200 once one succeeds, not never."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tidal.server import app as app_module


class _Engine:
    """generate() fails for the first `failures` warm-up requests, then yields one output."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.ready = False

    async def generate(self, ids, params, request_id):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("engine process restarting")
        yield object()


def _state(engine: _Engine) -> SimpleNamespace:
    return SimpleNamespace(
        engine=engine,
        tokenizer=SimpleNamespace(encode=lambda text: [1, 2, 3]),
        limits=SimpleNamespace(max_input_tokens=16),
        config=SimpleNamespace(server=SimpleNamespace(warmup=True)),
        draining=False,
        warm=False,
        warmup_failures=0,
        warmup_error=None,
    )


def test_a_failed_warm_up_is_retried_until_it_succeeds() -> None:
    engine = _Engine(failures=3)  # two concurrent warm-up requests per attempt
    state = _state(engine)
    waits: list[float] = []
    seen: list[dict[str, object]] = []

    async def sleep(s: float) -> None:
        waits.append(s)
        seen.append(app_module.warmup_status(state))  # type: ignore[arg-type]  # what /health shows

    assert app_module.warmup_status(state) == {"status": "running", "failed_attempts": 0}  # type: ignore[arg-type]
    asyncio.run(app_module._warm(state, sleep))  # type: ignore[arg-type]
    assert state.warm and engine.ready
    assert waits == list(app_module._WARM_RETRY_S[:2])  # attempts 1 and 2 failed, 3 passed
    last_error = "RuntimeError: engine process restarting"
    assert seen == [
        {"status": "retrying", "failed_attempts": n, "last_error": last_error} for n in (1, 2)
    ]
    done = app_module.warmup_status(state)  # type: ignore[arg-type]
    assert done == {"status": "ok", "failed_attempts": 2, "last_error": last_error}


def test_draining_stops_the_retries() -> None:
    engine = _Engine(failures=10**9)
    state = _state(engine)

    async def sleep(s: float) -> None:
        state.draining = True

    asyncio.run(app_module._warm(state, sleep))  # type: ignore[arg-type]
    assert not state.warm and not engine.ready
