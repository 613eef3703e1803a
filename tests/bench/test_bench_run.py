"""Smoke test: `tidal bench run` against a tiny tidal server; the figures exist and agree with each other."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.tiny_server import ServerProcess, make_tiny_checkpoint, serve
from tidal.bench.cli import main as bench_main

NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("bench_tiny_ckpt"))
    yield from serve(
        ["--model", str(ckpt), "--kv-cache-bytes", str(4 << 20), "--served-model-name", "tiny",
         "--no-warmup", "--threads", "1"]
    )  # fmt: skip


def _ordered(lat: dict) -> bool:
    return lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"]


def _check_run(run: dict, requests: list[dict], with_pid: bool = False) -> None:
    assert run["num_requests"] == NUM_REQUESTS == len(requests)
    assert run["num_ok"] + run["num_errors"] == run["num_requests"]
    assert run["num_ok"] == NUM_REQUESTS, run["errors"]
    assert run["num_good"] <= run["num_ok"]
    assert 0 <= run["goodput_requests_per_s"] <= run["requests_per_s"]
    assert run["num_output_tokens"] == sum(r["num_output_tokens"] for r in requests)
    assert run["num_prompt_tokens"] == sum(r["num_prompt_tokens"] for r in requests)
    assert all(r["num_prompt_tokens"] > 0 and r["num_output_tokens"] > 0 for r in requests)
    # ignore_eos: every request generates its max_tokens (4..6 here).
    assert all(4 <= r["num_output_tokens"] <= 6 for r in requests)
    assert math.isclose(
        run["output_tokens_per_s"] * run["duration_s"], run["num_output_tokens"], rel_tol=1e-9
    )
    for name in ("ttft", "tpot", "e2e", "itl"):
        assert _ordered(run[name]), (name, run[name])
    assert run["ttft"]["count"] == NUM_REQUESTS
    assert run["ttft"]["p99_ms"] <= run["e2e"]["p99_ms"]
    for r in requests:
        assert r["sent_s"] <= r["first_token_s"] <= r["finished_s"]
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
    server = run["server"]
    assert server["num_samples"] >= 1
    assert server["max_waiting"] is not None and server["max_waiting"] >= 0
    assert server["max_kv_usage"] is not None and 0 <= server["max_kv_usage"] <= 1
    assert server["num_preemptions"] is not None and server["num_preemptions"] >= 0
    if with_pid:
        assert server["peak_rss_bytes"] is not None and server["peak_rss_bytes"] > 0
        assert 0 < server["peak_pss_bytes"] <= server["peak_rss_bytes"]


def test_bench_run_open_and_closed_loop(tiny_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    md = tmp_path / "table.md"
    argv = [
        "run", "--base-url", tiny_server.base_url, "--num-requests", str(NUM_REQUESTS),
        "--workload", "range", "--input-len", "10-30", "--output-len", "4-6",
        "--request-rate", "inf", "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9",
        "--server-pid", str(tiny_server.proc.pid), "--json", str(out), "--markdown", str(md),
        "--plots", str(tmp_path / "plots"), "--no-progress", "--metrics-interval-s", "0.2",
    ]  # fmt: skip
    assert bench_main(argv) == 0
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 1 and doc["runs"][0]["target"] == "tiny"
    _check_run(doc["runs"][0], doc["requests"][0], with_pid=True)
    assert doc["runs"][0]["num_good"] == NUM_REQUESTS  # an SLO nobody misses
    assert md.read_text().count("\n| tiny | rate=inf/s | 8/8 |") == 1
    for png in ("bench_latency.png", "bench_timeline.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_run_chat_sessions_closed_loop(tiny_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    argv = [
        "run", "--base-url", tiny_server.base_url, "--model", "tiny",
        "--num-requests", str(NUM_REQUESTS), "--workload", "chat", "--turns", "2",
        "--system-len", "4", "--input-len", "2-4", "--output-len", "4-6", "--api", "chat",
        "--concurrency", "3", "--slo-ttft-ms", "0.001", "--warmup", "0", "--json", str(out), "--no-progress",
    ]  # fmt: skip
    assert bench_main(argv) == 0
    doc = json.loads(out.read_text())
    run, requests = doc["runs"][0], doc["requests"][0]
    _check_run(run, requests)
    assert run["load"] == "concurrency=3"
    assert run["num_good"] == 0 and run["goodput_requests_per_s"] == 0  # nobody meets 1 us
    # Turn 1 of a session carries turn 0's history, so its prompt is longer.
    assert requests[4]["num_prompt_tokens"] > requests[0]["num_prompt_tokens"]
