"""POST /v1/responses (OpenAI's Responses API): the request, and the chat request it runs as.

A response is a chat completion with another shape: `input` (text, or a list of messages,
function calls and their outputs) plus `instructions` become chat messages; function tools,
`tool_choice`, `text.format` and `max_output_tokens` become chat's fields. So tidal serves one
request path, with its templates, tool parsers, reasoning parsers, grammars and limits.

Nothing is stored: `store` is answered false, and what needs a stored response
(`previous_response_id`, `background`, item references) is refused with a 400, as is any tool
type but `function` and any input part but text. Logprobs come on the output text
(`include: ["message.output_text.logprobs"]`, `top_logprobs`) where the answer is all text.
`prompt_cache_key` is chat's too: a session_id, so the prefix cache keeps the conversation's
turns (what OpenAI's key is for).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationInfo, field_validator

from tidal.server.errors import APIError, bad_request
from tidal.server.protocol import ChatCompletionRequest, _Request, parse_request
from tidal.server.unserved import RESPONSES_UNSERVED, unless_default

# Chat fields a Responses body may carry too (vLLM's sampling extensions, tidal's own): passed on.
PASSED_ON = frozenset({
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "logit_bias", "skip_special_tokens", "chat_template_kwargs", "priority", "session_id",
    "timeout_s", "queue_timeout_s", "parallel_tool_calls", "user", "prompt_cache_key",
})  # fmt: skip
# What `include` may name: the output text's token logprobs (top_logprobs sets how many
# alternatives each has).
LOGPROBS = "message.output_text.logprobs"
# The roles of Responses messages (tool results are function_call_output items).
_ROLES = ("user", "assistant", "system", "developer")
# A chat error's param -> the Responses field the client sent.
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "truncate_prompt_tokens": "truncation",
    "reasoning_effort": "reasoning.effort",
    "top_logprobs": "top_logprobs",
}


class ResponsesRequest(_Request):
    """The fields tidal serves; others are ignored, as chat ignores unknown fields."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None  # answered false: nothing is kept
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    # Refused unless absent or their default (RESPONSES_UNSERVED): they need stored responses or
    # features tidal lacks
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    background: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None

    @field_validator(*RESPONSES_UNSERVED)
    @classmethod
    def _unserved(cls, v: Any, info: ValidationInfo) -> Any:
        return unless_default(RESPONSES_UNSERVED, v, info)

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        other = [x for x in v or [] if x != LOGPROBS]
        if other:
            raise ValueError(f"{other!r} is not supported: only {LOGPROBS!r} is")
        return v

    @property
    def wants_logprobs(self) -> bool:
        """include names the output text's logprobs, or top_logprobs asks for alternatives."""
        return LOGPROBS in (self.include or []) or bool(self.top_logprobs)

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and any(v.get(k) is not None for k in ("summary", "generate_summary")):
            raise ValueError(
                "reasoning summaries are not supported: a reasoning model's thought comes back "
                "whole as a reasoning item"
            )
        return v


def chat_request(
    req: ResponsesRequest, body: dict[str, Any], stream: bool
) -> ChatCompletionRequest:
    """The chat request `req` runs as; `body` is the decoded JSON (for the passed-on extras). A
    400 names the Responses field."""
    chat: dict[str, Any] = {k: body[k] for k in PASSED_ON if body.get(k) is not None}
    chat["model"] = req.model
    chat["messages"] = messages(req)
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}  # usage for response.completed
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.truncation == "auto":
        chat["truncate_prompt_tokens"] = -1  # drop the oldest tokens that do not fit
    if req.wants_logprobs:
        chat["logprobs"], chat["top_logprobs"] = True, req.top_logprobs or 0
    if req.reasoning and req.reasoning.get("effort") is not None:
        chat["reasoning_effort"] = req.reasoning["effort"]  # for a template that reads it
    if req.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = _format(req.text)
    if fmt is not None:
        chat["response_format"] = fmt
    try:
        return parse_request(ChatCompletionRequest, chat)
    except APIError as e:
        raise renamed(e) from None


def renamed(err: APIError) -> APIError:
    """A chat error as the Responses request's: its param named as the client sent it."""
    if err.param is None:
        return err
    if err.param.startswith("messages"):  # input and instructions, as chat turns
        return APIError(err.status, err.message, err.type, "input", err.code, err.headers)
    head, _, rest = err.param.partition(".")
    name = _PARAMS.get(err.param) or _PARAMS.get(head)
    if name is None:
        return err
    param = name if err.param in _PARAMS or not rest else f"{name}.{rest}"
    message = err.message.replace(err.param, param)
    return APIError(err.status, message, err.type, param, err.code, err.headers)


def messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` then `input` as chat messages."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    reasoning: str | None = None  # a reasoning item, for the assistant turn after it
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise bad_request(f"input[{i}].type must be a string", f"input[{i}].type")
        where = f"input[{i}]"
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise bad_request(
                    f"{where}.role is {item.get('role')!r}: expected one of {', '.join(_ROLES)}",
                    f"{where}.role",
                )
            msg = {"role": item["role"], "content": _text(item.get("content"), where)}
            if msg["role"] == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn's calls together
            else:
                turn = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    turn["reasoning_content"], reasoning = reasoning, None
                out.append(turn)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": output if isinstance(output, str) else _text(output, where),
                }
            )
        elif kind == "reasoning":
            parts = [p for k in ("content", "summary") for p in _list(item.get(k), where, k)]
            reasoning = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        else:
            raise bad_request(
                f"{where} has type {kind!r}: tidal serves message, function_call, "
                "function_call_output and reasoning items (nothing is stored to refer to)",
                f"{where}.type",
            )
    return out


def _text(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or its text parts as chat's text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of parts", f"{where}.content"
        )
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise bad_request(
                f"{where}.content[{j}] has type {kind!r}: only text parts (input_text, "
                "output_text) are served by a text model",
                f"{where}.content[{j}].type",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _list(value: Any, where: str, key: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"{where}.{key} must be a list", f"{where}.{key}")
    return value


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(
            f"tools[{i}] has type {tool.get('type')!r}: tidal serves function tools only "
            "(hosted tools such as web_search run at OpenAI)",
            f"tools[{i}].type",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: chat's own words
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f"tool_choice {choice!r} is not served: expected auto, none, required or "
        '{"type": "function", "name": ...}',
        "tool_choice",
    )


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None for plain text)."""
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    raise bad_request(
        f"text.format type {fmt.get('type')!r}: expected text, json_object or json_schema",
        "text.format.type",
    )
