"""Request guards every API route runs first: bearer auth, the body size limit and the model name."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from tidal.server.errors import body_too_large, invalid_api_key, model_not_found
from tidal.server.state import ServerState


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
