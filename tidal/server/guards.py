"""Request guards every API route runs first: bearer auth, the body size limit and the model name."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TypeVar

from starlette.requests import Request

from tidal.server.errors import (
    body_too_large,
    deadline_unmeetable,
    invalid_api_key,
    model_not_found,
    not_json,
)
from tidal.server.state import ServerState

T = TypeVar("T")


def state_of(request: Request) -> ServerState:
    return request.app.state.tidal


def check_auth(request: Request, state: ServerState) -> None:
    """401 unless server.api_keys is empty or the bearer token is one of them (constant-time compare)."""
    keys = state.config.server.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    ok = scheme.lower() == "bearer" and any(
        hmac.compare_digest(token.encode(), key.encode()) for key in keys
    )
    if not ok:
        raise invalid_api_key()


async def admit(request: Request, parse: Callable[[bytes], T]) -> tuple[ServerState, T]:
    """The gate of every model route, in order: auth (401), media type (415), body size (413),
    parse (400), model name (404). Returns the server state and the parsed request."""
    state = state_of(request)
    check_auth(request, state)
    check_json(request)
    req = parse(await read_body(request, state))
    check_model(req.model, state)  # type: ignore[attr-defined]
    return state, req


def check_json(request: Request) -> None:
    """415 for a body declared as anything but JSON (application/json or a +json type; no
    Content-Type is read as JSON). A browser sends a form or text/plain from any page without a
    preflight, so reading those as JSON would let any site drive a server with no key, as
    FastAPI's body parsing (vLLM's) also refuses them."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        raise not_json(declared)


async def read_body(request: Request, state: ServerState) -> bytes:
    """The body, or 413 as soon as it passes server.max_body_bytes (Content-Length or streamed)."""
    limit = state.config.server.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(model: str | None, state: ServerState) -> None:
    if model is not None and model != state.served_name:
        raise model_not_found(model, [state.served_name])


# Retry-After stays within [1 s (the header's unit), 60 s (past that a client does better
# trying another replica than sleeping)].
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0
# Admission refuses a deadline only when the estimated wait is this many times over it: the
# estimate is rough, and refusing a request that would have made it is the worse mistake.
DEADLINE_MARGIN = 2.0


def estimated_wait_s(num_ahead: int, completions_per_s: float | None) -> float | None:
    """How long `num_ahead` queued requests take to clear at the recent finish rate; None: unknown."""
    if completions_per_s is None or completions_per_s <= 0:
        return None
    return num_ahead / completions_per_s


def clamp_retry_after_s(wait_s: float | None) -> float:
    """The Retry-After for an estimated wait: the wait clamped to [1, 60] s, 1 s when unknown."""
    if wait_s is None:
        return MIN_RETRY_AFTER_S
    return min(max(wait_s, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)


def _completions_per_s(state: ServerState) -> float | None:
    return state.engine.completions_per_s()


def _num_waiting(state: ServerState) -> int:
    stats = state.engine.stats
    return stats.num_waiting if stats is not None else 0


def retry_after_s(state: ServerState, num_ahead: int | None = None) -> float:
    """Retry-After for a refused request: the queue (`num_ahead`, else the engine's waiting
    count) over the recent completions per second, clamped."""
    ahead = _num_waiting(state) if num_ahead is None else num_ahead
    return clamp_retry_after_s(estimated_wait_s(ahead, _completions_per_s(state)))


def check_deadline(timeout_s: float | None, state: ServerState) -> None:
    """429 when the queue ahead is estimated to take over DEADLINE_MARGIN times `timeout_s`."""
    if timeout_s is None:
        return
    wait_s = estimated_wait_s(_num_waiting(state), _completions_per_s(state))
    if wait_s is not None and wait_s > DEADLINE_MARGIN * timeout_s:
        raise deadline_unmeetable(timeout_s, wait_s, clamp_retry_after_s(wait_s))
