"""Report: a Markdown table, a JSON record and PNG plots (Agg) of benchmark runs."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tidal.bench.run_stats import RunStats
from tidal.bench.stream_client import RequestRecord

_COLUMNS = (
    ("target", "target"),
    ("load", "load"),
    ("ok", "ok/n"),
    ("req_s", "req/s"),
    ("tok_s", "out tok/s"),
    ("goodput", "goodput req/s"),
    ("ttft", "TTFT p50/p90/p99 ms"),
    ("tpot", "TPOT p50/p90/p99 ms"),
    ("e2e", "E2E p50/p99 ms"),
    ("queue", "max queue"),
    ("util", "batch util"),
    ("kv", "max KV"),
    ("pre", "preempt"),
    ("acc", "draft acc"),
    ("rss", "peak RSS MiB"),
    ("pss", "peak PSS MiB"),
)


def _num(v: float | None, fmt: str = ".0f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _row(s: RunStats) -> dict[str, str]:
    srv = s.server
    return {
        "target": s.target,
        "load": s.load,
        "ok": f"{s.num_ok}/{s.num_requests}",
        "req_s": _num(s.requests_per_s, ".2f"),
        "tok_s": _num(s.output_tokens_per_s, ".1f"),
        "goodput": _num(s.goodput_requests_per_s, ".2f"),
        "ttft": "/".join(_num(v) for v in (s.ttft.p50_ms, s.ttft.p90_ms, s.ttft.p99_ms)),
        "tpot": "/".join(_num(v, ".1f") for v in (s.tpot.p50_ms, s.tpot.p90_ms, s.tpot.p99_ms)),
        "e2e": "/".join(_num(v) for v in (s.e2e.p50_ms, s.e2e.p99_ms)),
        "queue": _num(srv.max_waiting),
        "util": _num(srv.mean_batch_utilization, ".2f"),
        "kv": _num(srv.max_kv_usage, ".2f"),
        "pre": _num(srv.num_preemptions),
        "acc": _num(srv.draft_acceptance, ".2f"),
        "rss": _num(None if srv.peak_rss_bytes is None else srv.peak_rss_bytes / 2**20),
        "pss": _num(None if srv.peak_pss_bytes is None else srv.peak_pss_bytes / 2**20),
    }


def markdown_table(runs: Sequence[RunStats]) -> str:
    """One row per run; '-' where a figure does not exist (e.g. a target without /metrics)."""
    head = "| " + " | ".join(title for _, title in _COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    rows = ["| " + " | ".join(_row(s)[key] for key, _ in _COLUMNS) + " |" for s in runs]
    return "\n".join([head, rule, *rows]) + "\n"


BEGIN_MARK, END_MARK = "<!-- bench:table:begin -->", "<!-- bench:table:end -->"


def write_markdown(path: str | Path, text: str) -> None:
    """Write `text` to `path`; when the file holds the two table markers, replace only what lies
    between them, so `--markdown benchmarks/README.md` regenerates the README's table in place."""
    p = Path(path)
    old = p.read_text() if p.exists() else ""
    if BEGIN_MARK in old and END_MARK in old.split(BEGIN_MARK, 1)[1]:
        head, rest = old.split(BEGIN_MARK, 1)
        tail = rest.split(END_MARK, 1)[1]
        p.write_text(f"{head}{BEGIN_MARK}\n{text.rstrip()}\n{END_MARK}{tail}")
    else:
        p.write_text(text)


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, load average (the box may be shared)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in load],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def write_json(
    path: str | Path,
    runs: Sequence[RunStats],
    records: Sequence[Sequence[RequestRecord]] | None = None,
    meta: dict[str, Any] | None = None,
) -> None:
    """Runs (with the probe's samples) and, when given, every request's record, as one JSON file."""
    doc: dict[str, Any] = {
        "machine": machine_info(),
        **(meta or {}),
        "runs": [asdict(s) for s in runs],
    }
    if records is not None:
        doc["requests"] = [[asdict(r) for r in rs] for rs in records]
    Path(path).write_text(json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n")


def _clean(doc: Any) -> Any:
    """Strict JSON: NaN (a percentile of nothing) becomes null, an infinite rate "inf"."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return None if math.isnan(doc) else ("inf" if doc > 0 else "-inf")
    if isinstance(doc, dict):
        return {k: _clean(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_clean(v) for v in doc]
    return doc


def write_plots(out_dir: str | Path, runs: Sequence[RunStats], prefix: str = "bench") -> list[Path]:
    """`<prefix>_latency.png` (TTFT/TPOT/E2E p50 and throughput against offered load, one line per
    target) and `<prefix>_timeline.png` (queue depth and batch utilization over each run)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_target: dict[str, list[RunStats]] = {}
    for s in runs:
        by_target.setdefault(s.target, []).append(s)

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        (axes[0][0], "TTFT p50 (ms)", lambda s: s.ttft.p50_ms),
        (axes[0][1], "TPOT p50 (ms)", lambda s: s.tpot.p50_ms),
        (axes[1][0], "E2E p99 (ms)", lambda s: s.e2e.p99_ms),
        (axes[1][1], "output tokens/s", lambda s: s.output_tokens_per_s),
    )
    for ax, title, get in panels:
        for target, rs in by_target.items():
            xs = [_offered(s, i) for i, s in enumerate(rs)]
            ax.plot(xs, [get(s) for s in rs], marker="o", label=target)
        ax.set_title(title)
        ax.set_xlabel("offered load (req/s, or concurrency)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    latency_png = out / f"{prefix}_latency.png"
    fig.savefig(latency_png, dpi=100)
    plt.close(fig)

    fig, (ax_q, ax_u) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for s in runs:
        samples = s.server.samples
        label = f"{s.target} {s.load}"
        ts = [p.t_s - samples[0].t_s for p in samples] if samples else []
        ax_q.plot(ts, [_nan(p.num_waiting) for p in samples], label=label)
        ax_u.plot(ts, [_nan(p.batch_utilization) for p in samples], label=label)
    ax_q.set_ylabel("requests waiting")
    ax_u.set_ylabel("batch utilization")
    ax_u.set_xlabel("seconds into the run")
    for ax in (ax_q, ax_u):
        ax.grid(alpha=0.3)
    ax_q.legend(fontsize=7)
    fig.tight_layout()
    timeline_png = out / f"{prefix}_timeline.png"
    fig.savefig(timeline_png, dpi=100)
    plt.close(fig)
    return [latency_png, timeline_png]


def _offered(s: RunStats, i: int) -> float:
    if s.offered_rate is not None:
        return s.offered_rate if math.isfinite(s.offered_rate) else float("nan")
    return float(s.concurrency if s.concurrency is not None else i)


def _nan(v: float | None) -> float:
    return math.nan if v is None else v
