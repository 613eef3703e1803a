"""ServerProbe: samples a server's Prometheus /metrics and its process tree's RSS while a run goes on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Each quantity under the names tidal, vLLM, llama.cpp's llama-server and the HF baseline use.
_WAITING = ("tidal:num_requests_waiting", "vllm:num_requests_waiting", "llamacpp:requests_deferred", "hf_static:num_requests_waiting")  # fmt: skip
_RUNNING = ("tidal:num_requests_running", "vllm:num_requests_running", "llamacpp:requests_processing", "hf_static:num_requests_running")  # fmt: skip
_KV = ("tidal:kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio")  # fmt: skip
_PREEMPTIONS = ("tidal:num_preemptions_total", "vllm:num_preemptions_total")
_DRAFTS = ("tidal:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total")
_ACCEPTED = ("tidal:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")  # fmt: skip
_BATCH_UTIL = (
    "tidal:batch_utilization"  # a histogram: utilization between samples = d(sum)/d(count)
)


@dataclass(slots=True)
class ProbeSample:
    """One scrape, `t_s` on the run's clock; None where the server does not export the quantity."""

    t_s: float
    num_waiting: float | None = None
    num_running: float | None = None
    kv_usage: float | None = None
    num_preemptions: float | None = None
    batch_utilization: float | None = None  # mean over the steps since the previous sample
    rss_bytes: int | None = None
    pss_bytes: int | None = None  # shared pages split between the processes that map them
    # Speculative decoding's counters (cumulative): draft tokens checked, and those kept.
    num_draft_tokens: float | None = None
    num_accepted_tokens: float | None = None


@dataclass(slots=True)
class ProbeSummary:
    """The run's view of the server: peaks and means over the samples, the preemptions in the run."""

    num_samples: int = 0
    max_waiting: float | None = None
    mean_waiting: float | None = None
    max_running: float | None = None
    mean_batch_utilization: float | None = None
    max_kv_usage: float | None = None
    num_preemptions: float | None = None
    # Of the draft tokens checked during the run, the share the model kept; None without any.
    draft_acceptance: float | None = None
    peak_rss_bytes: int | None = None
    peak_pss_bytes: int | None = None
    samples: list[ProbeSample] = field(default_factory=list)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value}, labels summed (enough for gauges/counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + float(s.value)
    return values


def _first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in values:
            return values[name]
    return None


def tree_memory_bytes(pid: int) -> tuple[int, int | None] | None:
    """(RSS, PSS) summed over `pid` and its descendants (the supervised engine is a child process).

    NOTE: RSS counts a shared page once per process that maps it (torch's libraries are mapped by
    the API process, the engine and the standby alike), so its sum overstates a process tree's
    memory; PSS splits each shared page between its sharers, so the sum is the tree's footprint.
    PSS is None where the OS does not report it (it needs Linux's smaps_rollup).
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    rss, pss, pss_known = 0, 0, True
    for p in procs:
        try:
            info = p.memory_full_info()  # smaps_rollup: PSS as well as RSS
        except psutil.AccessDenied:
            pss_known = False
            try:
                info = p.memory_info()
            except psutil.Error:
                continue
        except psutil.Error:  # a child that exited between listing and reading
            continue
        rss += info.rss
        pss_known = pss_known and hasattr(info, "pss")
        pss += getattr(info, "pss", 0)
    return rss, pss if pss_known else None


class ServerProbe:
    """Scrape `/metrics` (and RSS when `pid` is given) every `interval_s` until `stop()`."""

    def __init__(
        self,
        session: Any,  # aiohttp.ClientSession
        base_url: str,
        clock: Callable[[], float],
        pid: int | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self.session = session
        self.url = base_url.rstrip("/") + "/metrics"
        self.clock = clock
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[ProbeSample] = []
        self._stop = asyncio.Event()
        self._last_util: tuple[float, float] | None = None  # (sum, count) at the previous sample
        self.metrics_available = True

    async def run(self) -> None:
        while True:
            await self.sample_once()
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
                await self.sample_once()  # one last sample at the end of the run
                return
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    async def sample_once(self) -> None:
        sample = ProbeSample(self.clock())
        if self.metrics_available:
            try:
                async with self.session.get(self.url) as resp:
                    if resp.status == 200:
                        self.add_metrics(sample, parse_metrics(await resp.text()))
                    elif resp.status == 404:
                        self.metrics_available = False
            except Exception:  # a slow or missing /metrics must not fail the run
                pass
        if self.pid is not None:
            mem = tree_memory_bytes(self.pid)
            if mem is not None:
                sample.rss_bytes, sample.pss_bytes = mem
        self.samples.append(sample)

    def add_metrics(self, sample: ProbeSample, values: dict[str, float]) -> None:
        sample.num_waiting = _first(values, _WAITING)
        sample.num_running = _first(values, _RUNNING)
        sample.kv_usage = _first(values, _KV)
        sample.num_preemptions = _first(values, _PREEMPTIONS)
        sample.num_draft_tokens = _first(values, _DRAFTS)
        sample.num_accepted_tokens = _first(values, _ACCEPTED)
        if _BATCH_UTIL + "_count" in values:
            now = (values[_BATCH_UTIL + "_sum"], values[_BATCH_UTIL + "_count"])
            if self._last_util is not None and now[1] > self._last_util[1]:
                sample.batch_utilization = (now[0] - self._last_util[0]) / (
                    now[1] - self._last_util[1]
                )
            self._last_util = now

    def summary(self) -> ProbeSummary:
        return summarize_samples(self.samples)


def summarize_samples(samples: list[ProbeSample]) -> ProbeSummary:
    def vals(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    waiting, running = vals("num_waiting"), vals("num_running")
    util, kv, pre, rss, pss = (
        vals("batch_utilization"),
        vals("kv_usage"),
        vals("num_preemptions"),
        vals("rss_bytes"),
        vals("pss_bytes"),
    )
    drafted, accepted = vals("num_draft_tokens"), vals("num_accepted_tokens")
    drafts_in_run = drafted[-1] - drafted[0] if drafted else 0.0
    return ProbeSummary(
        num_samples=len(samples),
        max_waiting=max(waiting) if waiting else None,
        mean_waiting=sum(waiting) / len(waiting) if waiting else None,
        max_running=max(running) if running else None,
        mean_batch_utilization=sum(util) / len(util) if util else None,
        max_kv_usage=max(kv) if kv else None,
        # The counter is cumulative since the server started: the run's share is last - first.
        num_preemptions=pre[-1] - pre[0] if pre else None,
        draft_acceptance=(accepted[-1] - accepted[0]) / drafts_in_run
        if drafts_in_run > 0 and accepted
        else None,
        peak_rss_bytes=int(max(rss)) if rss else None,
        peak_pss_bytes=int(max(pss)) if pss else None,
        samples=samples,
    )
