"""Request fields tidal cannot honour, from vLLM's and OpenAI's APIs: each with the value that
asks for nothing (the field's default there) and what to do instead. Set to anything else, the
field is a 400 naming it, never a reply that silently ignores it (server/protocol.py)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo

UNSERVED: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "tidal does not run beam search (n samples several replies)"),
    "length_penalty": (1.0, "it applies to beam search, which tidal does not run"),
    "bad_words": ([], "ban a single-token word with logit_bias -100"),
    "allowed_token_ids": (None, "a choice or a grammar (structured_outputs) restricts the output"),
    "return_tokens_as_token_ids": (False, "/tokenize gives the ids of a text"),
    "guided_whitespace_pattern": (None, "JSON is written compact, without free whitespace"),
    "logits_processors": (None, "no custom logits processors are loaded"),
    "cache_salt": (None, "the prefix cache is shared by every request on this server"),
    "kv_transfer_params": (None, "tidal does not transfer KV between instances"),
    "vllm_xargs": (None, "no custom arguments are read"),
}

CHAT_UNSERVED: dict[str, tuple[Any, str]] = {
    "audio": (None, "tidal writes text only"),
    "web_search_options": (
        None,
        "tidal searches nothing: put what the model should read in the messages",
    ),
    "store": (False, "tidal stores no completions"),
    "verbosity": (
        frozenset({"medium"}),
        "the model's length follows max_completion_tokens and the messages",
    ),
    "service_tier": (
        frozenset({"auto", "default"}),
        "every request runs at one tier here: send priority",
    ),
    "echo": (False, "the reply holds the new message only"),
    "documents": (None, "pass documents in the messages"),
    "functions": (None, "the legacy functions field is not read: send tools"),
    "function_call": (None, "the legacy function_call field is not read: send tool_choice"),
}

# /v1/responses: what needs a stored response, or a feature tidal lacks (protocol_responses.py)
RESPONSES_UNSERVED: dict[str, tuple[Any, str]] = {
    "previous_response_id": (None, "tidal keeps no responses: send the whole conversation"),
    "conversation": (None, "tidal keeps no conversations: send the whole conversation"),
    "prompt": (None, "tidal keeps no prompt templates: send the instructions and input"),
    "background": (False, "background responses are not run: stream instead"),
    "max_tool_calls": (None, "the model's calls are not counted: bound max_output_tokens"),
    "service_tier": (
        frozenset({"auto", "default"}),
        "every request runs at one tier here: send priority",
    ),
}


def unless_default(table: dict[str, tuple[Any, str]], v: Any, info: ValidationInfo) -> Any:
    """`v` when it asks for nothing: null, the default, or one of a frozenset of defaults."""
    default, why = table[info.field_name]
    if isinstance(default, frozenset):
        fine = isinstance(v, str | int | float | bool) and v in default  # a list is no default
    else:
        fine = v == default
    if v is not None and not fine:
        raise ValueError(f"not supported ({why})")
    return v
