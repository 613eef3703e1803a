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
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
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


def check(spec: StructuredOutputs) -> None:
    """Raise GrammarError naming the problem when `spec` cannot be compiled."""
    to_grammar(spec)
