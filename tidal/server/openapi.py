"""The OpenAPI document served at /openapi.json: FastAPI's paths plus the request and response
bodies of the routes that parse their raw body themselves (so FastAPI cannot see the models)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tidal.server.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tidal.server.protocol_responses import ResponsesRequest
from tidal.server.protocol_tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tidal.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from tidal.server.unserved import CHAT_UNSERVED, RESPONSES_UNSERVED, UNSERVED

_REF = "#/components/schemas/{model}"
# One request body per route that any served model answers with 200 (the fuzz tests send it).
_EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Say hello", "max_tokens": 8},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_completion_tokens": 8,
    },
    "/v1/responses": {"input": "Say hello", "max_output_tokens": 8},
    "/tokenize": {"prompt": "Say hello"},
    "/detokenize": {"tokens": [2, 3]},
}

# path -> (method, request models (one of), 200 response model, whether it may stream SSE)
_ROUTES: dict[str, tuple[str, tuple[type[BaseModel], ...], type[BaseModel] | None, bool]] = {
    "/v1/completions": ("post", (CompletionRequest,), CompletionResponse, True),
    "/v1/chat/completions": ("post", (ChatCompletionRequest,), ChatCompletionResponse, True),
    # OpenAI's Response object: built as a dict (routes_responses.py), described by OpenAI
    "/v1/responses": ("post", (ResponsesRequest,), None, True),
    "/tokenize": (
        "post",
        (TokenizeCompletionRequest, TokenizeChatRequest),
        TokenizeResponse,
        False,
    ),
    "/detokenize": ("post", (DetokenizeRequest,), DetokenizeResponse, False),
    "/v1/models": ("get", (), ModelList, False),
    "/v1/models/{model}": ("get", (), ModelCard, False),
}
# Statuses each model route may answer besides 200 (errors.py builds every one of them).
_POST_ERRORS = {
    "400": "Malformed request or unsupported parameter (`param` names the field).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model name.",
    "413": "The body exceeds server.max_body_bytes.",
    "415": "The body was declared as something other than JSON (Content-Type).",
    "429": "The queue is full or the deadline cannot be met; see Retry-After.",
    "503": "Shutting down, or the engine restarted while the request ran (engine_restarted); "
    "see Retry-After.",
    "504": "The request's deadline (timeout_s or server.request_timeout_s) passed, or it was "
    "still queued when its queue_timeout_s (or server.queue_timeout_s) passed (queue_timeout).",
}
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
# What the validators (protocol.py, SamplingParams) accept but the pydantic types cannot say, so
# a schema-valid request is one the server serves. Per field: per JSON type of its non-null
# branch, keywords to add; or "anyOf" to replace the field's branches.
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_SAMPLING: dict[str, dict[str, Any]] = {
    "n": {"integer": {"minimum": 1}},
    "temperature": {"number": {"minimum": 0}},
    "top_p": {"number": {"exclusiveMinimum": 0, "maximum": 1}},
    "top_k": {"integer": {"minimum": -1}},
    "min_p": {"number": {"minimum": 0, "maximum": 1}},
    "presence_penalty": {"number": {"minimum": -2, "maximum": 2}},
    "frequency_penalty": {"number": {"minimum": -2, "maximum": 2}},
    "repetition_penalty": {"number": {"exclusiveMinimum": 0, "maximum": 10}},
    "min_tokens": {"integer": {"minimum": 0}},
    "max_tokens": {"integer": {"minimum": 0}},
    "stop": {
        "string": {"minLength": 1, "maxLength": MAX_STOP_CHARS},
        "array": {
            "maxItems": MAX_STOP_STRINGS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
        },
    },
    "stop_token_ids": {"array": {"items": {"type": "integer", "minimum": 0}}},
    "timeout_s": {"number": {"exclusiveMinimum": 0}},
    "queue_timeout_s": {"number": {"exclusiveMinimum": 0}},
    "session_id": {"string": {"minLength": 1, "maxLength": 256}},
    "logit_bias": {
        "object": {
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    },
}


def _asks_nothing(table: dict[str, tuple[Any, str]]) -> dict[str, dict[str, Any]]:
    """Fields refused unless they ask for nothing (server/unserved.py): null or their default."""
    return {
        name: {
            "anyOf": [
                {"type": "null"},
                {"enum": sorted(d)} if isinstance(d, frozenset) else {"const": d},
            ]
        }
        for name, (d, _) in table.items()
    }


_SAMPLING.update(_asks_nothing(UNSERVED))
_SAMPLING["truncate_prompt_tokens"] = {
    "anyOf": [{"type": "null"}, {"const": -1}, {"type": "integer", "minimum": 1}]
}
_MESSAGES = {"array": {"minItems": 1}}
# A request may name one of the checkpoint's templates; "default" is the one any checkpoint with a
# template has.
_TEMPLATE_NAME = {"anyOf": [{"type": "null"}, {"const": "default"}]}
_REFINE: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionRequest": {
        **_SAMPLING,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                _IDS,
                {"type": "array", "minItems": 1, "items": _IDS},
            ]
        },
        "suffix": {"string": {"maxLength": 0}},
    },
    "ChatCompletionRequest": {
        **_SAMPLING,
        "messages": _MESSAGES,
        "max_completion_tokens": {"integer": {"minimum": 0}},
        **_asks_nothing(CHAT_UNSERVED),
        "chat_template": _TEMPLATE_NAME,
        "modalities": {"array": {"items": {"const": "text"}}},
        # Tools are served (server/tools.py), but their shape (check_tools) is not written out
        # here, so a schema-valid request has none, and without tools OpenAI allows no
        # tool_choice but "none".
        "tools": {"array": {"maxItems": 0}},
        "tool_choice": {"anyOf": [{"type": "string", "const": "none"}, {"type": "null"}]},
        "response_format": {
            "object": {"required": ["type"], "properties": {"type": {"const": "text"}}}
        },
    },
    # content may be null (or absent) only in an assistant message: the schema asks for it always.
    "ChatMessage": {
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"$ref": _REF.format(model="TextPart")}},
            ]
        }
    },
    "TokenizeChatRequest": {"messages": _MESSAGES, "chat_template": _TEMPLATE_NAME},
    "ResponsesRequest": _asks_nothing(RESPONSES_UNSERVED),
    "DetokenizeRequest": {"tokens": {"array": {"items": {"type": "integer", "minimum": 0}}}},
}
_REQUIRED = {"ChatMessage": ["role", "content"]}
_PLAIN_GETS = {
    "/health": "200 while the engine process runs, 503 while it is down.",
    "/ready": "200 once warmed up and serving; 503 (not_ready) while loading, restarting or "
    "draining.",
    "/metrics": "Prometheus text exposition of every tidal:* metric.",
    "/version": 'The release serving: {"version": "0.1.0"}.',
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The document: FastAPI's own, with bodies, error responses and component schemas added."""
    doc = get_openapi(
        title="tidal",
        version="1",
        description="OpenAI-compatible completions, chat and responses, plus tokenize, health and "
        "metrics.",
        routes=app.routes,
    )
    requests = [(m, "validation") for r in _ROUTES.values() for m in r[1]]
    replies = [(r[2], "serialization") for r in _ROUTES.values() if r[2] is not None]
    keys, defs = models_json_schema(requests + replies, ref_template=_REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    _refine(schemas)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    error_ref = {"$ref": _REF.format(model="ErrorResponse")}
    for path, (method, models, reply, streams) in _ROUTES.items():
        op = doc["paths"][path][method]
        op.pop("requestBody", None)
        if models:
            refs = [keys[(m, "validation")] for m in models]
            schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
            media = {"schema": schema, "example": _EXAMPLES[path]}
            op["requestBody"] = {"required": True, "content": {"application/json": media}}
        ok: dict[str, Any] = {}
        if reply is not None:
            ok["application/json"] = {"schema": keys[(reply, "serialization")]}
        elif models:
            ok["application/json"] = {"schema": {"type": "object"}}
        if streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        op["responses"] = {"200": {"description": "Success.", "content": ok}}
        # Only the generating routes queue, restart or time out.
        codes = (
            _POST_ERRORS
            if streams
            else ("400", "401", "404", "413", "415")
            if models
            else ("401", "404")
            if "{model}" in path
            else ("401",)
        )
        errors = {c: _POST_ERRORS[c] for c in codes}
        for status, text in errors.items():
            op["responses"][status] = {
                "description": text,
                "content": {"application/json": {"schema": error_ref}},
            }
    for path, text in _PLAIN_GETS.items():
        media = "text/plain" if path == "/metrics" else "application/json"
        responses = {"200": {"description": text, "content": {media: {"schema": {}}}}}
        if path in ("/health", "/ready"):
            responses["503"] = {"description": "Not serving; see the 200's description."}
        doc["paths"][path]["get"]["responses"] = responses
    return doc


def _refine(schemas: dict[str, Any]) -> None:
    for model, fields in _REFINE.items():
        props = schemas[model]["properties"]
        for name, extra in fields.items():
            prop = props[name]
            if "anyOf" in extra:
                prop.pop("type", None)
                prop["anyOf"] = extra["anyOf"]
                continue
            for branch in prop.get("anyOf", [prop]):
                branch.update(extra.get(branch.get("type"), {}))
    for model, required in _REQUIRED.items():
        schemas[model]["required"] = required


def serve_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (and so /openapi.json) return build_openapi's document, built once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
