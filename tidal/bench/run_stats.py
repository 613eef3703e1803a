"""RunStats: one run's figures (throughput, goodput, latency percentiles) computed from its request records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.bench.server_probe import ProbeSummary
from tidal.bench.stream_client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); NaN for none."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class LatencyStats:
    """Mean and percentiles of one latency, in milliseconds."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of(cls, values_s: Sequence[float]) -> LatencyStats:
        ms = [v * 1000.0 for v in values_s]
        mean = sum(ms) / len(ms) if ms else math.nan
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(mean, p50, p90, p99, len(ms))


@dataclass(frozen=True, slots=True)
class SLO:
    """A request is good when its TTFT and TPOT are within these (None: no limit)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


@dataclass(slots=True)
class RunStats:
    """One run against one target at one offered load."""

    target: str
    load: str  # "rate=4.0/s" or "concurrency=8"
    offered_rate: float | None  # requests/s asked of the arrival process (None: closed loop)
    concurrency: int | None
    num_requests: int
    num_ok: int
    num_errors: int
    num_good: int  # ok and within the SLO
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    goodput_requests_per_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    slo: SLO
    server: ProbeSummary = field(default_factory=ProbeSummary)
    errors: list[str] = field(default_factory=list)  # the first few distinct messages

    def line(self) -> str:
        """One comparable line per run."""
        rss, pss = self.server.peak_rss_bytes, self.server.peak_pss_bytes
        return (
            f"{self.target} {self.load}: {self.num_ok}/{self.num_requests} ok in "
            f"{self.duration_s:.1f} s | {self.requests_per_s:.2f} req/s | "
            f"{self.output_tokens_per_s:.1f} out tok/s | goodput {self.goodput_requests_per_s:.2f} "
            f"req/s | TTFT p50 {self.ttft.p50_ms:.0f} p99 {self.ttft.p99_ms:.0f} ms | TPOT p50 "
            f"{self.tpot.p50_ms:.1f} ms | E2E p50 {self.e2e.p50_ms:.0f} ms"
            + (f" | peak RSS {rss / 2**20:.0f} MiB" if rss else "")
            + (f" (PSS {pss / 2**20:.0f} MiB)" if pss else "")
        )


def compute_stats(
    target: str,
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO,
    offered_rate: float | None = None,
    concurrency: int | None = None,
    server: ProbeSummary | None = None,
) -> RunStats:
    """Figures over `records`; `duration_s` is first send to last finish (the rate denominator)."""
    ok = [r for r in records if r.ok]
    good = [r for r in ok if slo.met_by(r)]
    out_tokens = sum(r.num_output_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    load = f"rate={offered_rate:g}/s" if offered_rate is not None else f"concurrency={concurrency}"
    errors: list[str] = []
    for r in records:
        if r.error and r.error not in errors and len(errors) < 5:
            errors.append(r.error)
    return RunStats(
        target=target,
        load=load,
        offered_rate=offered_rate,
        concurrency=concurrency,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        num_good=len(good),
        duration_s=duration_s,
        requests_per_s=per_s(len(ok)),
        output_tokens_per_s=per_s(out_tokens),
        goodput_requests_per_s=per_s(len(good)),
        num_prompt_tokens=sum(r.num_prompt_tokens or 0 for r in ok),
        num_output_tokens=out_tokens,
        ttft=LatencyStats.of([t for r in ok if (t := r.ttft_s) is not None]),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=LatencyStats.of([g for r in ok for g in r.itls_s]),
        e2e=LatencyStats.of([r.e2e_s for r in ok]),
        slo=slo,
        server=server or ProbeSummary(),
        errors=errors,
    )
