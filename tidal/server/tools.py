"""Tool calling on /v1/chat/completions: checking `tools` / `tool_choice`, the grammar that forces a
call, the prompt's tool text, and a choice's output -> `message.tool_calls` or stream deltas.

Modes (`ToolMode`): "none" (tools are not shown, the reply is text); "auto" (tools are rendered,
the family's parser reads calls out of the reply); "required" and "named" force a call with a
grammar (as vLLM does), so the output is JSON that always parses: "named" writes the function's
arguments object, "required" a list `[{"name": .., "parameters": {..}}, ..]` (one item unless
parallel_tool_calls). Their output is read directly, not through a family parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tidal.sampling_params import StructuredOutputs
from tidal.server.errors import bad_request
from tidal.server.tool_parsers import StreamingToolCalls, ToolCall, ToolParser, new_call_id

# The system text for templates that do not render tools themselves: the list of functions and
# the Hermes format the default parser reads.
_FALLBACK = (
    "You can call these functions. Their JSON schemas:\n{tools}\n\nTo call one, reply with "
    '<tool_call>{{"name": <function name>, "arguments": <arguments object>}}</tool_call> '
    "(one block per call) and nothing else."
)


@dataclass(frozen=True, slots=True)
class ToolMode:
    kind: str  # "none", "auto", "required", "named"
    tools: tuple[dict[str, Any], ...] = ()
    name: str | None = None  # the forced function ("named")
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.kind in ("required", "named")


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Pydantic validator body: each tool is {"type": "function", "function": {"name", ...}}."""
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(
                f"tool {i} must be {{'type': 'function', 'function': {{'name': <non-empty "
                "string>, 'parameters': <JSON schema>}}}}"
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tool {i} ({fn['name']}): parameters must be a JSON schema object")
    return tools


def tool_mode(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> ToolMode:
    """The request's mode, or a 400 naming tool_choice."""
    names = [t["function"]["name"] for t in tools or []]
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise _bad_choice(
                "a named choice must be {'type': 'function', 'function': {'name': <name>}}"
            )
        if name not in names:
            raise _bad_choice(f"function {name!r} is not in tools ({', '.join(names) or 'none'})")
        return ToolMode("named", tuple(tools or ()), name, parallel)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice not in ("none", "auto", "required"):
        raise _bad_choice(
            f"{choice!r} is not one of 'none', 'auto', 'required' or a named function"
        )
    if choice != "none" and not tools:
        raise _bad_choice(f"{choice!r} needs tools")
    return ToolMode(choice, tuple(tools or ()) if choice != "none" else (), None, parallel)


def _bad_choice(why: str) -> Exception:
    return bad_request(f"Invalid value for 'tool_choice': {why}", "tool_choice", "invalid_value")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def forced_spec(mode: ToolMode) -> StructuredOutputs | None:
    """The grammar that makes the reply a call (required / named), else None."""
    if mode.kind == "named":
        tool = next(t for t in mode.tools if t["function"]["name"] == mode.name)
        return StructuredOutputs("json", json.dumps(_parameters(tool)))
    if mode.kind != "required":
        return None
    items = [
        {
            "type": "object",
            # "name" first: the stream reads it before the arguments start.
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in mode.tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not mode.parallel:
        schema["maxItems"] = 1
    return StructuredOutputs("json", json.dumps(schema))


def with_tool_text(
    messages: list[dict[str, Any]], mode: ToolMode, template: str | None
) -> list[dict[str, Any]]:
    """Messages plus a system text listing the tools, for a template that never reads `tools`."""
    if not mode.tools or (template and "tools" in template):
        return messages
    listing = "\n".join(json.dumps(t["function"]) for t in mode.tools)
    text = _FALLBACK.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def plain_tool_turns(messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """For a template that knows no tools: an assistant turn's calls become its text (in the
    fallback's <tool_call> format) and tool results a user turn (consecutive ones merged), so
    templates that only alternate user/assistant still render the conversation."""
    if template and "tool" in template:
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(
                "<tool_call>"
                + json.dumps(
                    {"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}
                )
                + "</tool_call>"
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        elif m["role"] == "tool":
            text = f"Result of call {m.get('tool_call_id') or ''}: {m['content']}".replace(
                "call : ", "call: "
            )
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool_calls with their arguments as objects (what chat templates
    iterate over, as transformers and vLLM pass them)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except ValueError:
                pass  # a template may print the string as given
        out.append({**call, "function": fn})
    return {**m, "tool_calls": out}


def read_calls(mode: ToolMode, parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's (content, tool calls)."""
    if mode.kind == "named":
        assert mode.name is not None
        return None, [ToolCall(mode.name, text, new_call_id())]
    if mode.kind == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut by max_tokens: not a whole call
        return None, [ToolCall.make(i["name"], i["parameters"]) for i in items]
    if mode.kind == "auto":
        found = parser.split(text)
        if found is not None:
            content, calls = found
            return (content or None), calls
    return text, []


@dataclass(slots=True)
class CallDelta:
    """One streamed tool-call fragment: a call's start (id and name) or more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn = {"name": self.name, "arguments": self.arguments}
        out["function"] = fn
        return out


@dataclass(slots=True)
class ToolStream:
    """One choice's streamed reply -> (content, tool-call deltas), for every mode."""

    mode: ToolMode
    parser: ToolParser
    auto: StreamingToolCalls | None = None
    text: str = ""
    pos: int = 0  # required: characters of text consumed by the scanner
    num_calls: int = 0
    _scan: _ArgsScanner | None = None
    _stage: str = "name"  # required: "name" -> "params" -> "args" -> "name"
    _deltas: list[CallDelta] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode.kind == "auto":
            self.auto = StreamingToolCalls(self.parser)

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content and the tool-call fragments of one more piece of reply, at most one
        fragment per call (OpenAI's chunks hold one entry per index; a client that reads the
        first entry of an index lost the rest, e.g. a named call's opening `{"`)."""
        content, calls = self._feed(delta, final)
        merged: list[CallDelta] = []
        for call in calls:
            if merged and merged[-1].index == call.index:
                merged[-1].arguments += call.arguments
            else:
                merged.append(call)
        return content, merged

    def _feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        if self.mode.kind == "auto":
            assert self.auto is not None
            content, calls = self.auto.feed(delta, final)
            out = []
            for call in calls:
                out.append(CallDelta(self.num_calls, call.arguments, call.id, call.name))
                self.num_calls += 1
            return content, out
        if self.mode.kind == "named":
            out = []
            if self.num_calls == 0:
                out.append(CallDelta(0, "", new_call_id(), self.mode.name))
                self.num_calls = 1
            if delta:
                out.append(CallDelta(0, delta))
            return "", out
        if self.mode.kind == "required":
            self.text += delta
            return "", self._scan_required()
        return delta, []

    def _scan_required(self) -> list[CallDelta]:
        # The grammar fixes the layout: [{"name": "NAME", "parameters": ARGS}, ...] with ", "
        # and ": " separators; the arguments are streamed as they come, balanced by the scanner.
        out: list[CallDelta] = []
        while True:
            if self._stage == "name":
                key = '"name": "'
                start = self.text.find(key, self.pos)
                end = -1 if start < 0 else self.text.find('"', start + len(key))
                if end < 0:
                    return out
                name = json.loads(self.text[start + len(key) - 1 : end + 1])
                out.append(CallDelta(self.num_calls, "", new_call_id(), name))
                self.pos, self._stage = end + 1, "params"
            elif self._stage == "params":
                key = '"parameters": '
                start = self.text.find(key, self.pos)
                if start < 0:
                    return out
                self.pos, self._stage, self._scan = start + len(key), "args", _ArgsScanner()
            else:
                assert self._scan is not None
                piece, done = self._scan.feed(self.text[self.pos :])
                self.pos += len(piece)
                if piece:
                    out.append(CallDelta(self.num_calls, piece))
                if not done:
                    return out
                self.num_calls += 1
                self._stage = "name"


class _ArgsScanner:
    """Finds where a JSON value ends in text that arrives in pieces (strings and escapes aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, text: str) -> tuple[str, bool]:
        """(the part of `text` that belongs to the value, whether the value is complete)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
            if self.started and self.depth == 0:
                return text[: i + 1], True
        return text, False
