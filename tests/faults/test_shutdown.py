"""Graceful shutdown of a real `tidal serve`: SIGTERM during an open stream stops new requests,
lets the stream finish (or, past server.drain_timeout_s, ends it with an error event and
[DONE]), and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server.tiny_server import ServerProcess

# Bounds that turn a hang into a failure; nothing asserts how long anything took.
DEADLINE_S = 120.0
# A drained shutdown exits 0 (tidal's server drops the signal uvicorn would re-raise).
CLEAN_EXITS = (0,)
# Long enough that the stream is still running once the first token is seen; ignore_eos is set.
MAX_TOKENS = 200


def _start(checkpoint: Path, drain_timeout_s: float, monkeypatch: pytest.MonkeyPatch, **env: str):
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # ServerProcess copies os.environ
    server = ServerProcess(
        [
            "--model", str(checkpoint),
            "--kv-cache-bytes", str(4 << 20),
            "--max-num-seqs", "1",
            "--drain-timeout-s", str(drain_timeout_s),
            "--no-warmup",
        ]
    )  # fmt: skip
    server.wait_ready()
    return server


def _stream(
    server: ServerProcess, max_tokens: int, first: threading.Event, usage: bool = False
) -> list[str]:
    """Every `data:` payload of one streamed completion, [DONE] included (and, with `usage`, the
    usage chunk before it)."""
    body = {"prompt": "Tide", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    if usage:
        body["stream_options"] = {"include_usage": True}
    lines = []
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, timeout=DEADLINE_S
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: ") :])
                first.set()
    return lines


def _refused(server: ServerProcess, path: str) -> bool:
    """True when a new request to `path` is turned away (port closed, or 503 while draining)."""
    try:
        r = httpx.get(server.base_url + path, timeout=10)
    except httpx.HTTPError:
        return True
    return r.status_code == 503


def _sigterm_and_check_refusals(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + DEADLINE_S
    while not _refused(server, "/ready"):
        assert time.monotonic() < deadline, server.log
        time.sleep(0.02)
    # Once turned away, it stays so: no /ready 200 and no new completion while draining.
    assert _refused(server, "/ready")
    try:
        r = httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10
        )
        assert r.status_code == 503, r.text
    except httpx.HTTPError:
        pass


def test_sigterm_lets_an_open_stream_finish_and_exits_0(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = _start(tiny_checkpoint, 60.0, monkeypatch)
    try:
        first = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream, server, MAX_TOKENS, first, True)
            assert first.wait(DEADLINE_S), server.log
            # The engine is paused from the first streamed token until the refusals are seen,
            # so the signal provably lands while the stream is open (its other 199 tokens
            # cannot be computed in between), however fast the machine.
            with server.engine_paused():
                _sigterm_and_check_refusals(server)
                assert not stream.done(), "the stream ended before the signal"
            lines = stream.result(DEADLINE_S)
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert all("error" not in c for c in chunks), chunks
        assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
        # Every token was sent: the drain let the stream run to its end after the signal.
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS, chunks[-1]
        assert server.proc.wait(timeout=DEADLINE_S) in CLEAN_EXITS, server.log
    finally:
        server.stop()


def test_past_the_drain_timeout_a_stream_gets_an_error_event_and_done(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine freezes once a request waits behind the running stream, so the stream is still
    # open when the drain timeout passes, however fast the machine; the watchdog stays away.
    server = _start(
        tiny_checkpoint,
        2.0,
        monkeypatch,
        TIDAL_ENGINE_FAULT="0:hang_when_waiting=1",
        TIDAL_SERVER_WATCHDOG_TIMEOUT_S="600",
    )
    try:
        first = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(_stream, server, 200, first)
            assert first.wait(DEADLINE_S), server.log
            waiting = pool.submit(
                httpx.post,
                server.base_url + "/v1/completions",
                json={"prompt": "Sea", "max_tokens": 4},
                timeout=DEADLINE_S,
            )
            deadline = time.monotonic() + DEADLINE_S
            while "the step loop hangs now" not in server.log:
                assert time.monotonic() < deadline, server.log
                time.sleep(0.02)
            _sigterm_and_check_refusals(server)
            lines = stream.result(DEADLINE_S)
            waiting_response = waiting.result(DEADLINE_S)
        assert lines[-1] == "[DONE]"
        events = [json.loads(line) for line in lines[:-1]]
        assert events[0]["choices"][0]["text"] != ""
        assert events[-1]["error"]["code"] == "not_ready"
        assert "shutting down" in events[-1]["error"]["message"]
        assert waiting_response.status_code == 503, waiting_response.text
        assert server.proc.wait(timeout=DEADLINE_S) in CLEAN_EXITS, server.log
        assert "drain timeout: ended 2 requests still running" in server.log
    finally:
        server.stop()
