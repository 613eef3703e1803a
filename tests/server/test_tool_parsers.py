"""Tool-call parsers on canned model outputs, whole and fed in pieces (tags split across tokens)."""

from __future__ import annotations

import json

import pytest

from tidal.server.tool_parsers import PARSERS, StreamingToolCalls, parser_for
from tidal.server.tools import ToolMode, ToolStream, read_calls

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"tz": "UTC"}
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def _ds_call(name: str, args: dict) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```"
        "<｜tool▁call▁end｜>"
    )


# (parser, model output, content before the calls, [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": ' + json.dumps(WEATHER)
     + '}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {"tz": "UTC"}}\n</tool_call>',
     "Let me check.\n", [("weather", WEATHER), ("time", TIME)]),
    ("llama3_json", '{"name": "weather", "parameters": ' + json.dumps(WEATHER) + "}", "",
     [("weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": ' + json.dumps(WEATHER)
     + '}; {"name": "time", "parameters": {"tz": "UTC"}}', "", [("weather", WEATHER), ("time", TIME)]),
    ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": ' + json.dumps(WEATHER)
     + '}, {"name": "time", "arguments": {"tz": "UTC"}}]', "", [("weather", WEATHER), ("time", TIME)]),
    ("deepseek_v3", "Sure." + DS_BEGIN + _ds_call("weather", WEATHER) + _ds_call("time", TIME)
     + DS_END, "Sure.", [("weather", WEATHER), ("time", TIME)]),
]  # fmt: skip


def _named(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_output(name: str, text: str, content: str, calls: list) -> None:
    found = PARSERS[name]().split(text)
    assert found is not None
    assert found[0] == content and _named(found[1]) == calls
    assert all(c.id.startswith("call_") for c in found[1])


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_in_pieces(name: str, text: str, content: str, calls: list, piece: int) -> None:
    stream = StreamingToolCalls(PARSERS[name]())
    shown, got = "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for i, delta in enumerate(pieces):
        c, new = stream.feed(delta, final=i == len(pieces) - 1)
        shown += c
        got.extend(new)
        assert not any(marker in shown for marker in ("<tool", "[TOOL", "<｜", '"name"'))
    assert shown == content and _named(got) == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("name", list(PARSERS))
def test_plain_text_is_content_and_a_broken_call_falls_back_to_text(name: str) -> None:
    parser = PARSERS[name]()
    assert parser.split("The weather is fine.") is None
    stream = StreamingToolCalls(parser)
    text = "Fine, thanks" + parser.start + '{"name": "weather", "argu'
    shown = "".join(stream.feed(ch)[0] for ch in text[:-1]) + stream.feed(text[-1], final=True)[0]
    if name == "llama3_json":  # its calls start the reply: text first is plain content
        assert shown == text
    else:
        assert shown == text and not stream.calls


def test_parser_choice() -> None:
    from tidal.config.server import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    assert parser_for(None, "chatml").name == "hermes"
    assert parser_for(None, "llama3").name == "llama3_json"
    assert parser_for(None, "gemma").name == "hermes"
    assert parser_for("mistral", "chatml").name == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser"):
        parser_for("nope", None)


@pytest.mark.parametrize("piece", [1, 4, 50])
def test_required_calls_stream_name_then_argument_fragments(piece: int) -> None:
    # The layout the "required" grammar produces, with braces and quotes inside strings.
    args = [{"city": 'Pa}ris \\" {', "n": [1, {"a": 2}]}, {}]
    text = json.dumps([{"name": "weather", "parameters": args[0]}, {"name": "t", "parameters": {}}])
    mode = ToolMode("required", ())
    stream = ToolStream(mode, PARSERS["hermes"]())
    calls: dict[int, dict] = {}
    for i in range(0, len(text), piece):
        content, deltas = stream.feed(text[i : i + piece], final=i + piece >= len(text))
        assert content == ""
        for d in deltas:
            if d.id is not None:
                calls[d.index] = {"name": d.name, "args": ""}
            calls[d.index]["args"] += d.arguments
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == [
        ("weather", args[0]),
        ("t", {}),
    ]
    assert _named(read_calls(mode, PARSERS["hermes"](), text)[1]) == [
        ("weather", args[0]),
        ("t", {}),
    ]
