"""Traces and arrival processes: seeded, the shapes each workload promises, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.bench.run import LoadSpec, arrival_times
from tidal.bench.stream_client import RequestOptions, request_body
from tidal.bench.trace import WorkloadSpec, build_trace, parse_length


def test_same_seed_same_trace() -> None:
    spec = WorkloadSpec("range", input_len=(5, 50), output_len=(1, 9))
    assert build_trace(spec, 20, seed=3) == build_trace(spec, 20, seed=3)
    assert build_trace(spec, 20, seed=3) != build_trace(spec, 20, seed=4)
    assert all(
        5 <= len(r.prompt.split()) <= 50 and 1 <= r.max_tokens <= 9
        for r in build_trace(spec, 20, 0)
    )


def test_mix_long_and_system_lengths() -> None:
    mix = build_trace(WorkloadSpec("mix"), 30, 0)
    assert {len(r.prompt.split()) for r in mix} == {512, 1024}
    assert all(len(r.prompt.split()) > 2048 for r in build_trace(WorkloadSpec("long"), 3, 0))
    sys_trace = build_trace(WorkloadSpec("system", input_len=(8, 8), system_len=40), 5, 0)
    heads = {r.prompt.split("\n\n")[0] for r in sys_trace}
    assert len(heads) == 1 and len(heads.pop().split()) == 40
    chat = build_trace(WorkloadSpec("system", system_len=3, api="chat"), 2, 0)
    assert chat[0].messages[0][0] == "system" and chat[0].messages[0] == chat[1].messages[0]


def test_chat_sessions_carry_their_history() -> None:
    spec = WorkloadSpec(
        "chat", input_len=(3, 6), output_len=(4, 4), turns=3, system_len=5, api="chat"
    )
    trace = build_trace(spec, 7, 0)  # 3 sessions: 3 + 3 + 1 turns
    assert [(r.turn, r.session) for r in trace] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    by_session = {}
    for r in trace:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.messages[: len(prev.messages)] == prev.messages
            assert nxt.messages[len(prev.messages)][0] == "assistant"
    text = build_trace(WorkloadSpec("chat", turns=2, system_len=5), 2, 0)
    assert text[1].prompt.startswith(text[0].prompt) and text[0].prompt.endswith("\nAssistant:")


def test_jsonl_workload(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hello", "max_tokens": 5}, {"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = build_trace(WorkloadSpec("jsonl", jsonl_path=str(path), output_len=(7, 7)), 3, 0)
    assert [(r.prompt, r.messages, r.max_tokens) for r in trace] == [
        ("hello", (), 5), ("", (("user", "hi"),), 7), ("hello", (), 5)]  # fmt: skip
    path.write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:1 is invalid"):
        build_trace(WorkloadSpec("jsonl", jsonl_path=str(path)), 1, 0)


def test_bad_inputs_are_value_errors() -> None:
    assert parse_length("64-256", "input_len") == (64, 256) and parse_length("9", "x") == (9, 9)
    with pytest.raises(ValueError, match="input_len='9-3' is invalid"):
        parse_length("9-3", "input_len")
    with pytest.raises(ValueError, match="workload='nope' is invalid"):
        build_trace(WorkloadSpec("nope"), 1, 0)
    with pytest.raises(ValueError, match="expected exactly one"):
        LoadSpec(rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="request_rate=0"):
        LoadSpec(rate=0)


def test_arrivals_are_seeded_gamma_gaps() -> None:
    a = arrival_times(200, rate=4.0, burstiness=1.0, seed=1)
    assert a == arrival_times(200, 4.0, 1.0, 1) and a[0] == 0.0 and a == sorted(a)
    # The mean gap is 1/rate in expectation; 200 draws land within 25% of it.
    assert a[-1] / 199 == pytest.approx(0.25, rel=0.25)
    assert arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    bursty, regular = arrival_times(200, 4.0, 0.2, 1), arrival_times(200, 4.0, 20.0, 1)
    gaps = lambda xs: [b - x for x, b in zip(xs, xs[1:])]  # noqa: E731
    assert max(gaps(bursty)) > max(gaps(regular))


def test_request_body() -> None:
    trace = build_trace(WorkloadSpec("fixed", input_len=(3, 3), output_len=(5, 5)), 1, 0)
    path, body = request_body(trace[0], RequestOptions("m"))
    assert path == "/v1/completions" and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chat = build_trace(WorkloadSpec("chat", turns=1, system_len=2, api="chat"), 1, 0)
    path, body = request_body(chat[0], RequestOptions("m", ignore_eos=False))
    assert path == "/v1/chat/completions" and body["messages"][0]["role"] == "system"
    assert "ignore_eos" not in body
