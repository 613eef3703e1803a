"""Constrained-output request fields (OpenAI's response_format, vLLM's structured_outputs and
guided_*) -> one checked StructuredOutputs, or a 400 naming the field and the problem."""

from __future__ import annotations

import json
from typing import Any

from tidal.sampling_params import StructuredOutputs
from tidal.server.errors import bad_request
from tidal.structured.grammar import GrammarError, check

# vLLM's structured_outputs keys that tidal serves; any other key is refused, not ignored.
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}

Found = list[tuple[str, StructuredOutputs]]  # (request param, its constraint)


def response_format_spec(value: dict[str, Any] | None) -> Found:
    """OpenAI's response_format: text (no constraint), json_object, json_schema."""
    if value is None:
        return []
    kind = value.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", StructuredOutputs("json_object"))]
    if kind == "json_schema":
        body = value.get("json_schema")
        schema = body.get("schema") if isinstance(body, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "Invalid value for 'response_format': json_schema.schema must be a JSON schema "
                "object",
                "response_format",
                "invalid_value",
            )
        return [("response_format", StructuredOutputs("json", json.dumps(schema)))]
    raise bad_request(
        f"Invalid value for 'response_format': type {kind!r} is not supported: expected "
        "'text', 'json_object' or 'json_schema'",
        "response_format",
        "invalid_value",
    )


def extra_specs(
    structured_outputs: dict[str, Any] | None,
    guided_json: str | dict[str, Any] | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> Found:
    """vLLM's `structured_outputs` object and its older `guided_*` fields."""
    found: Found = []
    for key, value in (structured_outputs or {}).items():
        param = f"structured_outputs.{key}"
        if value is None or value is False:
            continue
        if key == "json_object" and value is True:
            found.append((param, StructuredOutputs("json_object")))
        elif key in _STRUCTURED_KEYS:
            found.append((param, _spec(_STRUCTURED_KEYS[key], value, param)))
        else:
            raise bad_request(
                f"Invalid value for 'structured_outputs': key {key!r} is not supported: expected "
                "one of json, regex, choice, grammar, json_object",
                "structured_outputs",
                "invalid_value",
            )
    for param, kind, value in (
        ("guided_json", "json", guided_json),
        ("guided_regex", "regex", guided_regex),
        ("guided_choice", "choice", guided_choice),
        ("guided_grammar", "grammar", guided_grammar),
    ):
        if value is not None:
            found.append((param, _spec(kind, value, param)))
    return found


def _spec(kind: str, value: object, param: str) -> StructuredOutputs:
    if kind == "json" and isinstance(value, dict):
        return StructuredOutputs("json", json.dumps(value))
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise bad_request(
                f"Invalid value for '{param}': expected a non-empty list of non-empty strings",
                param,
                "invalid_value",
            )
        return StructuredOutputs("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        what = "a JSON schema (object or string)" if kind == "json" else "a non-empty string"
        raise bad_request(f"Invalid value for '{param}': expected {what}", param, "invalid_value")
    return StructuredOutputs(kind, value)


def one_spec(found: Found) -> StructuredOutputs | None:
    """The request's one constraint, compiled once here so a bad one is a 400 before submit."""
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise bad_request(
            f"Only one output constraint may be given; got {names}", found[1][0], "invalid_value"
        )
    param, spec = found[0]
    try:
        check(spec)
    except GrammarError as e:
        raise bad_request(f"Invalid value for '{param}': {e}", param, "invalid_value") from None
    return spec
