"""tidal:engine_process_memory_bytes: the engine process's RSS, next to the API process's own."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx2 as httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.server.tiny_server import ServerProcess
from tidal.server.metrics import ServerMetrics


def _gauges(metrics_text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if not s.labels
    }


def _scrape(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=30).text


def test_live_server_reports_the_engine_process_rss(server: ServerProcess) -> None:
    m = re.search(r"engine process (\d+) ready \(incarnation 0,", server.log)
    assert m is not None, server.log
    engine = psutil.Process(int(m.group(1)))
    assert engine.ppid() == server.proc.pid  # the supervised child, not the API process
    # Idle first (no test's request still finishing), then a scrape between two equal reads:
    # an idle process's RSS is the same page count read after read, whatever the CPU load, so
    # a moving one (memory pressure, a late free) is read again instead of widening the band.
    server.wait_until(lambda: _gauges(_scrape(server))["tidal:num_requests_running"] == 0, "idle")
    for _ in range(20):
        before = engine.memory_info().rss
        text = _scrape(server)
        after = engine.memory_info().rss
        if before == after:
            break
    g = _gauges(text)
    # 10% is allocator noise at most; the regressions (0, a dead pid, the API process's RSS,
    # here ~20% smaller than the engine's) land outside it.
    assert 0.9 * min(before, after) <= g["tidal:engine_process_memory_bytes"]
    assert g["tidal:engine_process_memory_bytes"] <= 1.1 * max(before, after)
    api_rss = psutil.Process(server.proc.pid).memory_info().rss
    assert 0.9 * api_rss <= g["tidal:process_memory_bytes"] <= 1.1 * api_rss


def test_engine_gauge_follows_the_pid_and_is_0_without_one() -> None:
    metrics = ServerMetrics()
    assert _gauges(metrics.render().decode())["tidal:engine_process_memory_bytes"] == 0.0
    # The child says when its interpreter is up: its RSS still grows while Python starts.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == b"up\n"
    pid: list[int | None] = [child.pid]
    metrics.watch_engine(lambda: pid[0])
    try:
        before = psutil.Process(child.pid).memory_info().rss
        value = _gauges(metrics.render().decode())["tidal:engine_process_memory_bytes"]
        after = psutil.Process(child.pid).memory_info().rss
        assert 0.9 * min(before, after) <= value <= 1.1 * max(before, after)
    finally:
        child.communicate(b"")
    # The process is gone (a restart in progress reports pid None; a stale pid reads as 0).
    assert _gauges(metrics.render().decode())["tidal:engine_process_memory_bytes"] == 0.0
    pid[0] = None
    assert _gauges(metrics.render().decode())["tidal:engine_process_memory_bytes"] == 0.0
