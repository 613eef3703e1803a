"""`tidal serve --tensor-parallel 2`: the openai SDK gets answers, and SIGKILL of rank 1 under
load restarts the whole group (started requests end with the retryable 503, waiting ones finish
on the new group, /ready comes back)."""

from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest

from tests.faults.test_engine_restart import (
    DEADLINE_S,
    KV_BYTES,
    _check_recovery,
    _engine_pid,
    _long_stream,
    _metrics,
    _ready_status,
    _short,
)
from tests.server.tiny_server import ServerProcess


def _rank1_pid(server: ServerProcess, incarnation: int) -> int:
    engine = _engine_pid(server, incarnation)
    workers = [
        p.pid
        for p in psutil.Process(engine).children()
        if "tidal.executor.worker" in " ".join(p.cmdline())
    ]
    assert len(workers) == 1, (workers, server.log)
    assert re.search(rf"tensor-parallel rank 1/2 started: pid {workers[0]}\b", server.log)
    return workers[0]


def test_two_ranks_serve_and_a_killed_rank_restarts_the_group(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first engine freezes its step loop once 3 requests wait behind the long one, so the
    # kill lands mid-request; the watchdog is far away, so only the lost rank ends that engine.
    monkeypatch.setenv("TIDAL_ENGINE_FAULT", "0:hang_when_waiting=3")
    monkeypatch.setenv("TIDAL_SERVER_WATCHDOG_TIMEOUT_S", "600")
    server = ServerProcess(
        ["--model", str(tiny_checkpoint), "--kv-cache-bytes", KV_BYTES, "--max-num-seqs", "1",
         "--tensor-parallel", "2"]
    )  # fmt: skip
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=DEADLINE_S)
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
        assert answer.choices[0].text != ""
        rank1 = _rank1_pid(server, 0)
        first_chunk = threading.Event()
        prompts = ["Hello", "Tidal wave", "Sea"]
        with ThreadPoolExecutor(4) as pool:
            long_run = pool.submit(_long_stream, server, first_chunk)
            assert first_chunk.wait(DEADLINE_S), server.log
            shorts = [pool.submit(_short, server, p) for p in prompts]
            server.wait_until(
                lambda: _metrics(server).get("tidal:num_requests_waiting") == 3,
                "3 requests waiting",
                DEADLINE_S,
            )
            os.kill(rank1, signal.SIGKILL)
            server.wait_until(lambda: _ready_status(server) == 503, "/ready 503", DEADLINE_S)
            server.wait_until(lambda: _ready_status(server) == 200, "/ready 200 again", DEADLINE_S)
            long_lines = long_run.result(DEADLINE_S)
            waiting = [(p, f.result(DEADLINE_S)) for p, f in zip(prompts, shorts, strict=True)]
        _check_recovery(server, long_lines, waiting)
        m = _metrics(server)
        assert m["tidal:engine_restarts_total"] == 1
        assert m["tidal:requests_failed_total{reason=engine_died}"] == 1
        assert "tensor-parallel rank 1" in server.log and "the group is lost" in server.log
        assert not psutil.pid_exists(rank1) or psutil.Process(rank1).status() == "zombie"
        _rank1_pid(server, 1)  # the new engine has its own rank 1
    finally:
        server.stop()
