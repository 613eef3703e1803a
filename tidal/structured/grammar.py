"""StructuredOutputs -> an llguidance grammar, checked without a tokenizer (torch-free: the API
process validates requests with it before they reach the engine)."""

from __future__ import annotations

import functools
import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from tidal.sampling_params import StructuredOutputs

# Compact JSON separators when whitespace is not flexible: a greedy small model that may write
# free whitespace can repeat it until max_tokens.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE = {"whitespace_flexible": True}


_LABELS = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class GrammarError(ValueError):
    """The spec cannot be compiled; the message names the problem."""


@functools.lru_cache(maxsize=256)
def to_grammar(spec: StructuredOutputs) -> str:
    """The llguidance grammar text for `spec`; GrammarError when it is not valid."""
    try:
        grammar = _translate(spec)
    except GrammarError:
        raise
    except Exception as e:  # llguidance and the GBNF converter raise ValueError / RuntimeError
        raise GrammarError(f"invalid {_LABELS[spec.kind]}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {_LABELS[spec.kind]}: {error}")
    return grammar


def _translate(spec: StructuredOutputs) -> str:
    options = _FLEXIBLE if spec.whitespace_flexible else _COMPACT
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("invalid JSON schema: expected a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(closed(schema), defaults=options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid choice: not a JSON list ({e})") from None
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise GrammarError("invalid choice: expected a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    # kind == "grammar": Lark, or GBNF/EBNF (llama.cpp's `::=` rules) converted to Lark.
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.spec))


# Keywords whose value is a schema or a list of schemas, and those whose value maps names to
# schemas.
_SUBSCHEMAS = (
    "additionalProperties", "unevaluatedProperties", "items", "prefixItems", "additionalItems",
    "unevaluatedItems", "contains", "propertyNames", "not", "if", "then", "else",
)  # fmt: skip
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object whose properties may come from elsewhere too: its own list is not the whole.
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")


def closed(schema: object, keep_open: bool = False) -> object:
    """`schema` with every object that lists `properties` (or `patternProperties`) and says
    nothing about others closed to them (`additionalProperties: false`), as vLLM's default
    grammar engine (xgrammar's strict mode) treats a schema: a small model otherwise invents keys
    (tool calls with arguments the function does not take). A schema that wants other keys says
    `"additionalProperties": true` (or a schema for them). An object whose properties are also
    listed elsewhere stays open: one that combines schemas (allOf, $ref, ...) and the members of
    an allOf, or of an anyOf/oneOf beside properties of its own, since `additionalProperties`
    sees only its sibling `properties` and closing would refuse what the whole allows."""
    if isinstance(schema, list):
        return [closed(s, keep_open) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed(out[key])
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    lists = "properties" in out or "patternProperties" in out
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = closed(out[key], keep_open=key == "allOf" or lists)
    says = any(k in out for k in ("additionalProperties", "unevaluatedProperties"))
    if lists and not says and not keep_open and not any(k in out for k in _COMPOSED):
        out["additionalProperties"] = False
    return out


def check(spec: StructuredOutputs) -> None:
    """Raise GrammarError naming the problem when `spec` cannot be compiled."""
    to_grammar(spec)
