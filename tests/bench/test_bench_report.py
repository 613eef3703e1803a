"""Run statistics, the /metrics probe and the report writers on synthetic records (no server)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tidal.bench.report import markdown_table, write_json, write_plots
from tidal.bench.run_stats import SLO, compute_stats, percentile
from tidal.bench.server_probe import (
    ProbeSample,
    ServerProbe,
    parse_metrics,
    summarize_samples,
    tree_memory_bytes,
)
from tidal.bench.stream_client import RequestRecord, _carries_token

METRICS_T0 = """# TYPE tidal:num_requests_waiting gauge
tidal:num_requests_waiting 3.0
tidal:num_requests_running 2.0
tidal:kv_cache_usage_ratio 0.25
tidal:num_preemptions_total 4.0
tidal:spec_decode_num_draft_tokens_total 100.0
tidal:spec_decode_num_accepted_tokens_total 60.0
tidal:batch_utilization_bucket{le="1.0"} 10.0
tidal:batch_utilization_count 10.0
tidal:batch_utilization_sum 5.0
"""
METRICS_T1 = METRICS_T0.replace("_count 10.0", "_count 14.0").replace("_sum 5.0", "_sum 8.0")
METRICS_T1 = METRICS_T1.replace("preemptions_total 4.0", "preemptions_total 6.0")
METRICS_T1 = METRICS_T1.replace("draft_tokens_total 100.0", "draft_tokens_total 140.0")
METRICS_T1 = METRICS_T1.replace("accepted_tokens_total 60.0", "accepted_tokens_total 90.0")


def _record(
    i: int, sent: float, first: float | None, end: float, n_out: int, err: str | None = None
) -> RequestRecord:
    chunks = (
        []
        if first is None
        else [first + k * (end - first) / max(n_out - 1, 1) for k in range(n_out)]
    )
    return RequestRecord(i, sent, sent, first, end, chunks, 10, n_out if err is None else 0, err)


def _records() -> list[RequestRecord]:
    return [
        _record(0, 0.0, 0.1, 1.1, 11),  # TTFT 100 ms, TPOT 100 ms
        _record(1, 0.5, 0.8, 2.8, 5),  # TTFT 300 ms, TPOT 500 ms
        _record(2, 1.0, 1.2, 2.2, 3),  # TTFT 200 ms, TPOT 500 ms
        _record(3, 1.5, None, 1.6, 0, err="HTTP 429: busy"),
    ]


def test_percentile_matches_numpy() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_compute_stats_counts_goodput_and_latencies() -> None:
    stats = compute_stats(
        "t", _records(), duration_s=2.8, slo=SLO(ttft_ms=250, tpot_ms=600), offered_rate=2.0
    )
    assert (stats.num_requests, stats.num_ok, stats.num_errors) == (4, 3, 1)
    assert stats.num_good == 2  # request 1 misses the TTFT SLO; request 3 failed
    assert stats.requests_per_s == pytest.approx(3 / 2.8)
    assert stats.goodput_requests_per_s == pytest.approx(2 / 2.8)
    assert stats.num_output_tokens == 19 and stats.output_tokens_per_s == pytest.approx(19 / 2.8)
    assert stats.ttft.p50_ms == pytest.approx(200) and stats.ttft.count == 3
    assert stats.tpot.p50_ms == pytest.approx(500) and stats.tpot.mean_ms == pytest.approx(1100 / 3)
    assert stats.e2e.p99_ms == pytest.approx(float(np.percentile([1100, 2300, 1200], 99)))
    assert stats.itl.count == 10 + 4 + 2
    assert stats.errors == ["HTTP 429: busy"] and stats.load == "rate=2/s"
    assert compute_stats("t", _records(), 2.8, SLO(tpot_ms=200)).num_good == 1


def test_parse_metrics_and_probe_batch_utilization() -> None:
    values = parse_metrics(METRICS_T0)
    assert (
        values["tidal:num_requests_waiting"] == 3.0
        and values["tidal:batch_utilization_count"] == 10.0
    )
    probe = ServerProbe(session=None, base_url="http://x", clock=lambda: 0.0)
    s0, s1 = ProbeSample(0.0), ProbeSample(0.5)
    probe.add_metrics(s0, values)
    probe.add_metrics(s1, parse_metrics(METRICS_T1))
    assert (s0.num_waiting, s0.num_running, s0.kv_usage) == (3.0, 2.0, 0.25)
    assert s0.batch_utilization is None  # no earlier sample to difference against
    assert s1.batch_utilization == pytest.approx(3.0 / 4.0)
    summary = summarize_samples([s0, s1, ProbeSample(1.0, rss_bytes=123)])
    assert summary.num_preemptions == 2.0 and summary.max_waiting == 3.0
    assert summary.draft_acceptance == pytest.approx(30 / 40)  # of the run's 40 drafts, 30 kept
    assert summarize_samples([s0, s0]).draft_acceptance is None  # none drafted in the run
    assert summary.peak_rss_bytes == 123 and summary.num_samples == 3
    assert summary.peak_pss_bytes is None  # no sample had it


def test_llama_cpp_metric_names() -> None:
    probe = ServerProbe(session=None, base_url="http://x", clock=lambda: 0.0)
    s = ProbeSample(0.0)
    probe.add_metrics(
        s, parse_metrics("llamacpp:requests_deferred 2\nllamacpp:requests_processing 4\n")
    )
    assert (s.num_waiting, s.num_running, s.batch_utilization) == (2.0, 4.0, None)


def test_token_chunks() -> None:
    assert _carries_token({"choices": [{"text": "a", "finish_reason": None}]})
    assert _carries_token({"choices": [{"text": "", "finish_reason": None}]})  # half a character
    assert not _carries_token({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not _carries_token({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert _carries_token({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]})
    assert _carries_token({"choices": [{"delta": {"reasoning_content": "hm", "reasoning": "hm"}}]})
    assert not _carries_token({"choices": [], "usage": {"completion_tokens": 3}})


def test_report_writers(tmp_path: Path) -> None:
    a = compute_stats("tidal", _records(), 2.8, SLO(), offered_rate=2.0)
    a.server = summarize_samples(
        [
            ProbeSample(0.0, 1, 1, 0.1, 0, None, 10 << 20, 6 << 20),
            ProbeSample(0.5, 3, 2, 0.2, 0, 0.5),
        ]
    )
    b = compute_stats(
        "tidal", _records()[3:], 0.1, SLO(), offered_rate=math.inf
    )  # all failed: NaNs
    c = compute_stats("hf-static", _records()[:2], 2.8, SLO(), concurrency=4)
    table = markdown_table([a, b, c])
    lines = table.strip().splitlines()
    assert len(lines) == 5
    assert lines[2].startswith("| tidal | rate=2/s | 3/4 | 1.07 | 6.8 | 1.07 | 200/280/298 |")
    assert lines[2].endswith("| 3 | 0.50 | 0.20 | 0 | - | 10 | 6 |")
    assert lines[3].startswith("| tidal | rate=inf/s | 0/1 | 0.00 | 0.0 | 0.00 | -/-/- |")
    path = tmp_path / "r.json"
    write_json(path, [a, b, c], [_records(), _records()[3:], _records()[:2]], {"note": "x"})
    doc = json.loads(path.read_text())  # strict JSON: no NaN
    assert doc["note"] == "x" and doc["machine"]["cpu_count"] >= 1
    assert doc["runs"][1]["ttft"]["p50_ms"] is None and doc["runs"][1]["offered_rate"] == "inf"
    assert doc["runs"][0]["server"]["samples"][1]["batch_utilization"] == 0.5
    assert len(doc["requests"][0]) == 4
    pngs = write_plots(tmp_path / "plots", [a, b, c], prefix="t")
    assert [p.name for p in pngs] == ["t_latency.png", "t_timeline.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_write_markdown_replaces_only_the_marked_table(tmp_path: Path) -> None:
    from tidal.bench.report import BEGIN_MARK, END_MARK, write_markdown

    plain = tmp_path / "t.md"
    write_markdown(plain, "| a |\n")
    assert plain.read_text() == "| a |\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{BEGIN_MARK}\nold table\n{END_MARK}\n\nmore text\n")
    write_markdown(readme, "| new |\n")
    assert readme.read_text() == f"# Title\n\n{BEGIN_MARK}\n| new |\n{END_MARK}\n\nmore text\n"


def test_tree_memory_counts_children_and_splits_shared_pages() -> None:
    # This process's tree holds the child, so its RSS is more than the child's alone; PSS (each
    # shared page split between the processes that map it) never exceeds RSS.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        alone = tree_memory_bytes(child.pid)
        both = tree_memory_bytes(os.getpid())
    finally:
        child.communicate(b"", timeout=30)
    assert alone is not None and both is not None
    assert both[0] > alone[0] > 0
    if sys.platform.startswith("linux"):
        assert alone[1] is not None and both[1] is not None
        assert 0 < alone[1] <= alone[0] and 0 < both[1] <= both[0]
