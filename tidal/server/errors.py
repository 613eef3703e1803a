"""APIError: an OpenAI-style error body with its HTTP status, and constructors for each failure the server reports.

The body is `{"error": {"message", "type", "param", "code"}}` on every status, so the `openai`
SDK raises its matching exception class (BadRequestError, AuthenticationError, NotFoundError,
RateLimitError, InternalServerError...) with `.param` and `.code` filled in.
"""

from __future__ import annotations

import json
import math

from pydantic import ValidationError


class APIError(Exception):
    """An error the server answers with `status` and `body()`; `headers` go on the response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        """The compact JSON response body."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False).encode()

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request is malformed or asks for something unsupported."""
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_api_key() -> APIError:
    """401: missing or wrong bearer key (the key itself is never echoed)."""
    return APIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
        "invalid_request_error",
        None,
        "invalid_api_key",
        {"WWW-Authenticate": "Bearer"},
    )


def model_not_found(model: str, served: list[str]) -> APIError:
    """404: `model` names no served model."""
    names = ", ".join(repr(s) for s in served)
    return APIError(
        404,
        f"The model {model!r} does not exist. Served models: {names}.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def not_found(path: str) -> APIError:
    """404 for an unknown route."""
    return APIError(404, f"No route {path!r}.", "invalid_request_error", None, "not_found")


def body_too_large(num_bytes: int | None, max_body_bytes: int) -> APIError:
    """413: the body exceeds server.max_body_bytes (num_bytes None when not yet known)."""
    size = "The request body" if num_bytes is None else f"The request body ({num_bytes} bytes)"
    return APIError(
        413,
        f"{size} exceeds the limit of {max_body_bytes} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def not_json(content_type: str) -> APIError:
    """415: a body sent as something other than JSON (what a browser form or a bare `curl -d`
    sends; a page on another site may send those without asking the server first)."""
    return APIError(
        415,
        f"The request body must be JSON, sent with 'Content-Type: application/json' "
        f"(got {content_type[:100]!r}).",
        "invalid_request_error",
        None,
        "unsupported_media_type",
    )


def _retry_after(retry_after_s: float) -> dict[str, str]:
    # Retry-After takes whole seconds; round up so a client never comes back early.
    return {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


def queue_full(max_queue: int | None, retry_after_s: float = 1.0) -> APIError:
    """429: the waiting queue is full; the SDK retries after Retry-After."""
    return APIError(
        429,
        f"The server is at capacity (server.max_queue={max_queue} waiting requests). Retry later.",
        "rate_limit_error",
        None,
        "queue_full",
        _retry_after(retry_after_s),
    )


def deadline_unmeetable(timeout_s: float, wait_s: float, retry_after_s: float) -> APIError:
    """429: the queue ahead is estimated to outlast the request's deadline; refused up front."""
    return APIError(
        429,
        f"The request cannot finish within its deadline of {timeout_s:g} s: the requests queued "
        f"ahead of it are estimated to take {wait_s:.1f} s at the current throughput. Retry "
        "later or with a longer timeout_s.",
        "rate_limit_error",
        "timeout_s",
        "deadline_unmeetable",
        _retry_after(retry_after_s),
    )


def not_ready(reason: str = "The model is still loading", retry_after_s: float = 5.0) -> APIError:
    """503: not ready yet (loading, warming up) or draining for shutdown."""
    return APIError(
        503,
        f"{reason}. Retry later.",
        "server_error",
        None,
        "not_ready",
        _retry_after(retry_after_s),
    )


def engine_restarted(retry_after_s: float, request_id: str | None = None) -> APIError:
    """503: the engine process died or hung while the request ran and is restarting; retry it."""
    ref = f" (request {request_id})" if request_id else ""
    return APIError(
        503,
        f"The engine restarted while the request was running{ref}; its output so far is lost. "
        "Retry the request.",
        "server_error",
        None,
        "engine_restarted",
        _retry_after(retry_after_s),
    )


def engine_unavailable(request_id: str | None = None) -> APIError:
    """503: the engine failed too often and this server is exiting; retry on another replica."""
    ref = f" (request {request_id})" if request_id else ""
    return APIError(
        503,
        f"The engine failed repeatedly and this server is shutting down{ref}. Retry the "
        "request on another replica.",
        "server_error",
        None,
        "engine_unavailable",
    )


def deadline_exceeded(timeout_s: float) -> APIError:
    """504: the request's deadline (its timeout_s or server.request_timeout_s) passed."""
    return APIError(
        504,
        f"The request did not finish within its deadline of {timeout_s:g} s.",
        "timeout_error",
        None,
        "deadline_exceeded",
    )


def queue_timeout(queue_timeout_s: float, retry_after_s: float) -> APIError:
    """504: the request was still queued when its queue_timeout_s (or server.queue_timeout_s)
    passed; the engine finished it with reason "deadline" before computing anything."""
    return APIError(
        504,
        f"The request did not start within its queue timeout of {queue_timeout_s:g} s: the "
        "server was busy with the requests ahead of it. Retry later or with a longer "
        "queue_timeout_s.",
        "timeout_error",
        "queue_timeout_s",
        "queue_timeout",
        _retry_after(retry_after_s),
    )


def internal_error(request_id: str | None = None) -> APIError:
    """500: a fault inside the server or the engine (a step raised), not a restart; the detail
    goes to the log under request_id, not to the client."""
    ref = f" (request {request_id})" if request_id else ""
    return APIError(
        500,
        f"The server failed while handling the request{ref}.",
        "server_error",
        None,
        "internal_error",
    )


def format_loc(loc: tuple[int | str, ...]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'; None for the body itself."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def from_validation_error(exc: ValidationError) -> APIError:
    """400 naming the first bad field, e.g. param 'temperature' or 'messages[0].role'."""
    first = exc.errors(include_url=False)[0]
    kind = first["type"]
    param = format_loc(tuple(first["loc"]))
    # A ValueError raised by a validator arrives as "Value error, <our message>".
    msg = first["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return bad_request(
            f"The request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}.",
            None,
            "invalid_json",
        )
    if param is None:
        if kind == "model_type":
            return bad_request("The request body must be a JSON object.", None)
        return bad_request(msg, None)
    if kind == "missing":
        return bad_request(
            f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
        )
    if kind not in ("value_error", "assertion_error"):
        # Pydantic's own messages do not say what it got; our validators' messages do.
        got = repr(first.get("input"))
        msg = f"{msg} (got {got if len(got) <= 60 else got[:57] + '...'})"
    return bad_request(f"Invalid value for '{param}': {msg}", param, "invalid_value")
