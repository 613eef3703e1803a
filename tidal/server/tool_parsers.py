"""Tool-call parsers: a model family's tool-call text -> OpenAI tool calls, whole or streamed.

Each family writes calls its own way:
  hermes (Qwen 2.5/3, Hermes)   <tool_call>{"name": .., "arguments": {..}}</tool_call> (repeated)
  llama3_json (Llama 3.1+)      {"name": .., "parameters": {..}} (optionally after <|python_tag|>,
                                several joined by ";")
  mistral                       [TOOL_CALLS][{"name": .., "arguments": {..}}, ..]
  deepseek_v3 (V3, R1)          <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                                ```json {..} ```<｜tool▁call▁end｜>..<｜tool▁calls▁end｜>

A parser splits text into the content before its first call and the calls. `StreamingToolCalls`
feeds a parser text deltas as they arrive (tags may be split across tokens): content is passed
on except a tail that might begin a call's start marker; once a call starts nothing more is
shown as content, and each call is emitted when the parser can read it whole.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)
    id: str = ""

    @staticmethod
    def make(name: str, arguments: object) -> ToolCall:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return ToolCall(name, args, new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """One family's format. `start` is the marker that opens the tool-call section."""

    name = ""
    start = ""

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, the calls), or None when the text holds no complete call."""
        raise NotImplementedError

    def call_start(self, text: str) -> int:
        """Where the tool-call section starts in `text`, or -1."""
        return text.find(self.start)

    def held_back(self, text: str) -> int:
        """How many trailing characters might begin the start marker (not shown yet)."""
        return _marker_prefix(text, self.start)


def _json_calls(payload: object, args_key: str) -> list[ToolCall] | None:
    items = payload if isinstance(payload, list) else [payload]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get(args_key, item.get("arguments", item.get("parameters", {})))
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall.make(item["name"], args))
    return calls


def _loads(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        begin = self.call_start(text)
        if begin < 0:
            return None
        calls: list[ToolCall] = []
        for body in self._CALL.findall(text, begin):
            parsed = _json_calls(_loads(body), "arguments")
            if parsed is None:
                return None
            calls.extend(parsed)
        return (text[:begin], calls) if calls else None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"
    _TAG = "<|python_tag|>"

    def call_start(self, text: str) -> int:
        # A call is the whole reply: JSON from its first character (after an optional tag).
        stripped = text.lstrip()
        offset = len(text) - len(stripped)
        if stripped.startswith(self._TAG):
            return offset
        return offset if stripped.startswith("{") else -1

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if self._TAG.startswith(stripped) else 0

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        begin = self.call_start(text)
        if begin < 0:
            return None
        body = text[begin:].removeprefix(self._TAG).strip()
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return None
            parsed = _json_calls(obj, "parameters")
            if parsed is None:
                return None
            calls.extend(parsed)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return (text[:begin], calls) if calls else None


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        begin = self.call_start(text)
        if begin < 0:
            return None
        body = text[begin + len(self.start) :].strip()
        try:
            obj, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return None
        calls = _json_calls(obj, "arguments")
        return (text[:begin], calls) if calls else None


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    start = "<｜tool▁calls▁begin｜>"
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
        r"\s*<｜tool▁call▁end｜>",
        re.DOTALL,
    )

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        begin = self.call_start(text)
        if begin < 0:
            return None
        calls = []
        for m in self._CALL.finditer(text, begin):
            args = _loads(m.group("args"))
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall.make(m.group("name").strip(), args))
        return (text[:begin], calls) if calls else None


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser)
}
# The chat family (loader/tokenizer.py) -> its parser, when --tool-call-parser is not given.
FAMILY_PARSERS = {"chatml": "hermes", "llama3": "llama3_json", "mistral": "mistral",
                  "deepseek": "deepseek_v3", "deepseek_v3": "deepseek_v3"}  # fmt: skip
DEFAULT_PARSER = "hermes"


def parser_for(name: str | None, family: str | None) -> ToolParser:
    """The named parser, else the family's, else hermes (the most common format)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(
                f"tool_call_parser={name!r} is invalid: expected one of {', '.join(PARSERS)}"
            )
        return PARSERS[name]()
    return PARSERS[FAMILY_PARSERS.get(family or "", DEFAULT_PARSER)]()


class StreamingToolCalls:
    """Feeds one choice's text deltas to a parser; returns (content to show, new whole calls)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.shown = 0  # characters of text passed on as content
        self.calls: list[ToolCall] = []
        self.in_calls = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if not self.in_calls:
            begin = self.parser.call_start(self.text)
            if begin >= 0:
                self.in_calls = True
                content = self.text[self.shown : begin]
                self.shown = begin
            else:
                # Hold back a tail that might be the start of the marker.
                keep = 0 if final else self.parser.held_back(self.text)
                content = self.text[self.shown : len(self.text) - keep]
                self.shown += len(content)
                return content, []
        else:
            content = ""
        found = self.parser.split(self.text)
        new: list[ToolCall] = []
        if found is not None:
            _, calls = found
            # Calls already emitted keep their ids; a later complete parse only adds calls.
            new = calls[len(self.calls) :]
            self.calls.extend(new)
        if final and self.in_calls and not self.calls:
            # The section never parsed: show it as the text it is.
            content += self.text[self.shown :]
            self.shown = len(self.text)
        return content, new


def _marker_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
