"""A real `tidal serve` whose engine process is SIGKILLed, hangs, or keeps dying: nobody hangs,
started requests fail with an error event, waiting ones finish on the restarted engine."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.tiny_server import ServerProcess

KV_BYTES = str(4 << 20)
# Generous bounds for a loaded 2-core machine; a bug shows up as a hang, which these turn into
# a failure instead of a stuck test run. Nothing here asserts how long anything took.
DEADLINE_S = 120.0


def _start(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> ServerProcess:
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # ServerProcess copies os.environ
    args = ["--model", str(checkpoint), "--kv-cache-bytes", KV_BYTES, "--max-num-seqs", "1"]
    return ServerProcess(args)


def _metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _wait_until(check, what: str, server: ServerProcess) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} never happened:\n{server.log}")


def _ready_status(server: ServerProcess) -> int:
    return httpx.get(server.base_url + "/ready", timeout=30).status_code


def _engine_pid(server: ServerProcess, incarnation: int) -> int:
    m = re.search(rf"engine process (\d+) ready \(incarnation {incarnation},", server.log)
    assert m is not None, server.log
    return int(m.group(1))


def _long_stream(server: ServerProcess, first_chunk: threading.Event) -> list[dict]:
    """A streamed completion that outlives the engine: every SSE data object it received."""
    body = {"prompt": "Tide", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    events = []
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, timeout=DEADLINE_S
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
                first_chunk.set()
    return events


def _short(server: ServerProcess, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=DEADLINE_S)


def _check_recovery(server: ServerProcess, long_events: list[dict], waiting: list) -> None:
    # The started request streamed tokens, then ended with an error event (never a hang).
    assert "choices" in long_events[0] and long_events[0]["choices"][0]["text"] != ""
    assert long_events[-1]["error"]["code"] == "internal_error"
    # The waiting ones ran on the new engine: the same text as the same request run afresh.
    for prompt, response in waiting:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice == _short(server, prompt).json()["choices"][0]


def test_sigkill_under_load_fails_started_and_reruns_waiting(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first engine freezes once 3 requests wait behind the running one, so the kill always
    # lands mid-stream; the watchdog is far away so only the kill ends it.
    server = _start(
        tiny_checkpoint,
        monkeypatch,
        TIDAL_ENGINE_FAULT="0:hang_when_waiting=3",
        TIDAL_SERVER_WATCHDOG_TIMEOUT_S="600",
    )
    try:
        server.wait_ready()
        first_chunk = threading.Event()
        prompts = ["Hello", "Tidal wave", "Sea"]
        with ThreadPoolExecutor(4) as pool:
            long_run = pool.submit(_long_stream, server, first_chunk)
            assert first_chunk.wait(DEADLINE_S), server.log
            shorts = [pool.submit(_short, server, p) for p in prompts]
            _wait_until(
                lambda: _metrics(server).get("tidal:num_requests_waiting") == 3,
                "3 requests waiting",
                server,
            )
            os.kill(_engine_pid(server, 0), signal.SIGKILL)
            _wait_until(lambda: _ready_status(server) == 503, "/ready 503", server)
            _wait_until(lambda: _ready_status(server) == 200, "/ready 200 again", server)
            long_events = long_run.result(DEADLINE_S)
            waiting = [(p, f.result(DEADLINE_S)) for p, f in zip(prompts, shorts, strict=True)]
        _check_recovery(server, long_events, waiting)
        m = _metrics(server)
        assert m["tidal:engine_restarts_total"] == 1
        assert m["tidal:engine_up"] == 1
        assert m["tidal:requests_failed_total{reason=engine_died}"] == 1
        assert "killed by signal 9" in server.log
    finally:
        server.stop()


def test_watchdog_catches_a_hung_engine(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = _start(
        tiny_checkpoint,
        monkeypatch,
        TIDAL_ENGINE_FAULT="0:hang_when_waiting=2",
        TIDAL_SERVER_WATCHDOG_TIMEOUT_S="3",
    )
    try:
        server.wait_ready()
        first_chunk = threading.Event()
        with ThreadPoolExecutor(3) as pool:
            long_run = pool.submit(_long_stream, server, first_chunk)
            assert first_chunk.wait(DEADLINE_S), server.log
            # Two wait behind the running one: the engine hangs; the watchdog must notice.
            prompts = ["Hello", "Sea"]
            shorts = [pool.submit(_short, server, p) for p in prompts]
            long_events = long_run.result(DEADLINE_S)
            waiting = [(p, f.result(DEADLINE_S)) for p, f in zip(prompts, shorts, strict=True)]
        _check_recovery(server, long_events, waiting)
        m = _metrics(server)
        assert m["tidal:engine_restarts_total"] == 1
        assert m["tidal:requests_failed_total{reason=engine_hung}"] == 1
        assert "engine down (hung): the engine made no progress" in server.log
        assert _ready_status(server) == 200
    finally:
        server.stop()


def test_spent_restart_budget_exits_non_zero(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first engine exits right after reporting ready; every restart dies before loading.
    server = _start(
        tiny_checkpoint,
        monkeypatch,
        TIDAL_ENGINE_FAULT="0:exit_when_ready,*:exit_on_start",
        TIDAL_SERVER_ENGINE_MAX_RESTARTS="2",
    )
    try:
        assert server.proc.wait(timeout=DEADLINE_S) == 1, server.log
        assert "giving up" in server.log
        assert server.log.count("died while starting (exit code 70)") == 2
    finally:
        server.stop()
