"""Trace: a seeded, replayable list of online requests (prompts, lengths, chat sessions) for `tidal bench`."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Common English words that are one token in the usual BPE/SentencePiece vocabularies (with the
# leading space), so "N words" is close to N prompt tokens; the exact count comes from `usage`.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we can been has more if no when will would "
    "who so what their out up about into them some could time these two may first then do any "
    "like my now over such our man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three"
).split()
WORKLOADS = ("fixed", "range", "mix", "chat", "long", "system", "jsonl")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `prompt` is sent to /v1/completions; `messages` (when set) to
    /v1/chat/completions. Turns of one session (`session`, `turn`) run in order: a turn is sent
    only after the previous turn of its session finished, because its prompt carries that history."""

    index: int
    max_tokens: int
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    session: int | None = None
    turn: int = 0

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to generate. Lengths are in words (about one token each); `name` is one of WORKLOADS."""

    name: str = "mix"
    input_len: tuple[int, int] = (128, 128)  # (min, max) words; fixed when min == max
    output_len: tuple[int, int] = (32, 32)  # (min, max) max_tokens
    turns: int = 4  # chat: turns per session
    system_len: int = 256  # system/chat: shared system-prompt words
    api: str = "completions"  # chat/system: "chat" sends messages, "completions" a transcript
    jsonl_path: str | None = None


def parse_length(text: str, field_name: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-256' -> (64, 256)."""
    try:
        lo, _, hi = text.partition("-")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(
            f"{field_name}={text!r} is invalid: expected N or MIN-MAX (positive integers)"
        ) from None
    if not 1 <= low <= high:
        raise ValueError(f"{field_name}={text!r} is invalid: expected 1 <= MIN <= MAX")
    return low, high


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def build_trace(spec: WorkloadSpec, num_requests: int, seed: int) -> list[TraceRequest]:
    """The trace for `spec`: the same arguments always give the same requests."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} is invalid: expected an integer >= 1")
    if spec.name not in WORKLOADS:
        raise ValueError(f"workload={spec.name!r} is invalid: expected one of {WORKLOADS}")
    if spec.api not in ("completions", "chat"):
        raise ValueError(f"api={spec.api!r} is invalid: expected 'completions' or 'chat'")
    rng = random.Random(seed)
    if spec.name == "jsonl":
        return _from_jsonl(spec, num_requests)
    if spec.name == "chat":
        return _chat_sessions(spec, num_requests, rng)
    out = []
    system = _words(rng, spec.system_len) if spec.name == "system" else ""
    for i in range(num_requests):
        if spec.name == "mix":  # the 512/1024 mix: half the prompts of each length
            n_in = 512 if rng.random() < 0.5 else 1024
        elif spec.name == "long":  # past 2048 tokens: the chunked-prefill case
            n_in = rng.randint(2100, 3000)
        else:
            n_in = rng.randint(*spec.input_len)
        n_out = rng.randint(*spec.output_len)
        body = _words(rng, n_in)
        if spec.name == "system":
            if spec.api == "chat":
                out.append(TraceRequest(i, n_out, messages=(("system", system), ("user", body))))
            else:
                out.append(TraceRequest(i, n_out, prompt=f"{system}\n\n{body}"))
        else:
            out.append(TraceRequest(i, n_out, prompt=body))
    return out


def _chat_sessions(spec: WorkloadSpec, num_requests: int, rng: random.Random) -> list[TraceRequest]:
    """Sessions of `spec.turns` turns sharing one system prompt; turn k repeats turns 0..k-1
    (user text and a fixed assistant reply) so every target replays the same prompts."""
    if spec.turns < 1:
        raise ValueError(f"turns={spec.turns} is invalid: expected an integer >= 1")
    system = _words(rng, spec.system_len)
    num_sessions = -(-num_requests // spec.turns)
    out: list[TraceRequest] = []
    for s in range(num_sessions):
        history: list[tuple[str, str]] = [("system", system)]
        for t in range(spec.turns):
            if len(out) == num_requests:
                break
            history.append(("user", _words(rng, rng.randint(*spec.input_len))))
            n_out = rng.randint(*spec.output_len)
            if spec.api == "chat":
                out.append(
                    TraceRequest(len(out), n_out, messages=tuple(history), session=s, turn=t)
                )
            else:
                out.append(
                    TraceRequest(len(out), n_out, prompt=_transcript(history), session=s, turn=t)
                )
            # NOTE: a fixed reply, not the target's own: the next turn's prompt must not depend on
            # which server answered, or the targets would not replay one trace.
            history.append(("assistant", _words(rng, n_out)))
    # Interleave sessions (turn 0 of every session, then turn 1, ...) so they overlap in time.
    out.sort(key=lambda r: (r.turn, r.session))
    return [_reindex(r, i) for i, r in enumerate(out)]


def _reindex(r: TraceRequest, index: int) -> TraceRequest:
    return TraceRequest(index, r.max_tokens, r.prompt, r.messages, r.session, r.turn)


def _transcript(history: list[tuple[str, str]]) -> str:
    lines = [f"{role.capitalize()}: {content}" for role, content in history]
    return "\n".join(lines) + "\nAssistant:"


def _from_jsonl(spec: WorkloadSpec, num_requests: int) -> list[TraceRequest]:
    """One JSON object a line: {"prompt": str} or {"messages": [{"role", "content"}]}, optional
    "max_tokens"; the file is cycled when it has fewer lines than `num_requests`."""
    if not spec.jsonl_path:
        raise ValueError("jsonl_path=None is invalid: the jsonl workload needs --jsonl PATH")
    rows = []
    path = Path(spec.jsonl_path)
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno} is invalid JSON: {e}") from None
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise ValueError(
                f"{path}:{lineno} is invalid: expected an object with prompt or messages"
            )
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} is invalid: no requests in it")
    out = []
    for i in range(num_requests):
        row = rows[i % len(rows)]
        n_out = int(row.get("max_tokens", spec.output_len[1]))
        if "messages" in row:
            msgs = tuple((str(m["role"]), str(m["content"])) for m in row["messages"])
            out.append(TraceRequest(i, n_out, messages=msgs))
        else:
            out.append(TraceRequest(i, n_out, prompt=str(row["prompt"])))
    return out
