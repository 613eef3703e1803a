"""ServerMetrics: the Prometheus metrics of one server, in its own registry, fed by step stats and request outputs."""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tidal.engine.output import RequestDelta, RequestMetrics
from tidal.engine.stats import StepStats
from tidal.server.replica_metrics import ReplicaMetrics

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.6, 5.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_EXPERT_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class ServerMetrics:
    """All `tidal:*` metrics. `on_step` runs on the engine thread (prometheus_client is
    thread-safe); request metrics are observed by a `RequestTracker` per served request.

    With `num_replicas` > 1 (hardware.data_parallel) every metric one engine feeds (its queue,
    KV, prefix cache, steps, restarts, memory) carries a `replica` label ("0", "1", ...) and is
    fed through `replica(i)`; with one engine the names and series are unlabelled, as ever.
    Request metrics (latencies, tokens, outcomes) stay server-wide either way."""

    def __init__(
        self,
        device_memory_bytes: int | None = None,
        target_ttft_ms: float | None = None,
        target_tpot_ms: float | None = None,
        num_replicas: int = 1,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.num_replicas = num_replicas
        rl = ["replica"] if num_replicas > 1 else []  # the label of what one engine feeds
        self.ttft = Histogram("tidal:time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.itl = Histogram("tidal:inter_token_latency_seconds", "Gap between the steps that bring a request output tokens (tokens of accepted drafts arrive together, in one).", buckets=_ITL_BUCKETS_S, registry=r)  # fmt: skip
        self.e2e = Histogram("tidal:e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.queue_time = Histogram("tidal:request_queue_time_seconds", "Arrival to first scheduled.", buckets=_LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.running = Gauge("tidal:num_requests_running", "Sequences running in the engine.", labelnames=rl, registry=r)  # fmt: skip
        self.waiting = Gauge("tidal:num_requests_waiting", "Sequences waiting in the queue.", labelnames=rl, registry=r)  # fmt: skip
        self.kv_usage = Gauge("tidal:kv_cache_usage_ratio", "Fraction of KV blocks held by requests.", labelnames=rl, registry=r)  # fmt: skip
        # Counter names drop the _total suffix: prometheus_client appends it.
        self.prefix_queries = Counter("tidal:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labelnames=rl, registry=r)  # fmt: skip
        self.prefix_hits = Counter("tidal:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labelnames=rl, registry=r)  # fmt: skip
        self.preemptions = Counter("tidal:num_preemptions", "Sequences preempted.", labelnames=rl, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("tidal:prompt_tokens", "Prompt tokens of served requests.", registry=r)  # fmt: skip
        self.generation_tokens = Counter("tidal:generation_tokens", "Tokens generated.", registry=r)  # fmt: skip
        self.success = Counter("tidal:request_success", "Requests finished, by reason.", ["finished_reason"], registry=r)  # fmt: skip
        self.rejected = Counter("tidal:request_rejected", "Requests refused before or by the engine, by reason.", ["reason"], registry=r)  # fmt: skip
        self.batch_utilization = Histogram("tidal:batch_utilization", "Token utilization: scheduled tokens / token budget per step.", buckets=_RATIO_BUCKETS, labelnames=rl, registry=r)  # fmt: skip
        self.seat_utilization = Histogram("tidal:seat_utilization", "Seat utilization: running sequences / seat cap per step.", buckets=_RATIO_BUCKETS, labelnames=rl, registry=r)  # fmt: skip
        self.token_budget = Gauge("tidal:scheduler_token_budget", "The batch controller's token budget of the last step.", labelnames=rl, registry=r)  # fmt: skip
        self.prefill_budget = Gauge("tidal:scheduler_prefill_budget", "Of the token budget, the tokens prefill chunks may take.", labelnames=rl, registry=r)  # fmt: skip
        self.seat_cap = Gauge("tidal:scheduler_seat_cap", "The batch controller's running-sequence cap.", labelnames=rl, registry=r)  # fmt: skip
        self.headroom = Gauge("tidal:scheduler_headroom", "The controller's hysteresis factor on the TPOT target (1: the cost model is trusted).", labelnames=rl, registry=r)  # fmt: skip
        self.step_cost = Gauge("tidal:step_cost_seconds", "The step cost model: seconds per unit of each term.", labelnames=["term", *rl], registry=r)  # fmt: skip
        self.step_predicted = Histogram("tidal:step_duration_predicted_seconds", "The cost model's prediction of each step's time.", buckets=_ITL_BUCKETS_S, labelnames=rl, registry=r)  # fmt: skip
        # Per configured target (batching.target_ttft_ms / target_tpot_ms): requests that met it,
        # and goodput (requests that met every target).
        self.slo_requests = Counter("tidal:slo_requests", "Finished requests judged against each latency target.", ["slo", "result"], registry=r)  # fmt: skip
        self.slo_attainment = Gauge("tidal:slo_attainment", "Fraction of finished requests that met each latency target.", ["slo"], registry=r)  # fmt: skip
        self.goodput = Counter("tidal:goodput_requests", "Finished requests that met every latency target.", registry=r)  # fmt: skip
        self.targets_s: dict[str, float] = {}
        for slo, ms in (("ttft", target_ttft_ms), ("tpot", target_tpot_ms)):
            if ms is not None:
                self.targets_s[slo] = ms / 1000
                self.slo_attainment.labels(slo=slo).set(1.0)
        self._slo_counts: dict[str, list[int]] = {slo: [0, 0] for slo in self.targets_s}
        self.iteration_tokens = Histogram("tidal:iteration_tokens", "Tokens scheduled per step.", buckets=_TOKEN_BUCKETS, labelnames=rl, registry=r)  # fmt: skip
        self.moe_expert_tokens = Histogram("tidal:moe_expert_tokens", "MoE models: tokens routed to one expert in one step, summed over the sparse layers (one observation per expert per step).", buckets=_EXPERT_TOKEN_BUCKETS, labelnames=rl, registry=r)  # fmt: skip
        self.moe_imbalance = Gauge("tidal:moe_expert_load_imbalance", "MoE models: the last step's busiest expert's tokens over the mean per expert (1: even).", labelnames=rl, registry=r)  # fmt: skip
        self.constrained_requests = Counter("tidal:structured_output_requests", "Requests whose output a grammar constrains, by kind (json, json_object, regex, choice, grammar).", ["kind"], registry=r)  # fmt: skip
        self.grammar_mask = Histogram("tidal:grammar_mask_seconds", "Time to compute one step's grammar masks (all constrained rows; beside the forward).", buckets=_ITL_BUCKETS_S, labelnames=rl, registry=r)  # fmt: skip
        self.draft_tokens = Counter("tidal:spec_decode_num_draft_tokens", "Prompt-lookup draft tokens checked (batching.num_speculative_tokens).", labelnames=rl, registry=r)  # fmt: skip
        self.accepted_tokens = Counter("tidal:spec_decode_num_accepted_tokens", "Draft tokens the model agreed with: output tokens gained beside each step's own.", labelnames=rl, registry=r)  # fmt: skip
        self.step_duration = Histogram("tidal:step_duration_seconds", "Wall time of one engine step.", buckets=_ITL_BUCKETS_S, labelnames=rl, registry=r)  # fmt: skip
        self.process_memory = Gauge("tidal:process_memory_bytes", "Resident memory of the server process.", registry=r)  # fmt: skip
        self.memory_fraction = Gauge("tidal:memory_fraction", "Used / total memory of the serving device (RAM on CPU).", registry=r)  # fmt: skip
        self.model_load = Gauge("tidal:model_load_seconds", "Time to load the model.", labelnames=rl, registry=r)  # fmt: skip
        self.engine_restarts = Counter("tidal:engine_restarts", "Engine processes restarted after dying or hanging.", labelnames=rl, registry=r)  # fmt: skip
        self.engine_up = Gauge("tidal:engine_up", "1 while the engine is running, 0 while it is down or restarting.", labelnames=rl, registry=r)  # fmt: skip
        self.requests_failed = Counter("tidal:requests_failed", "Engine requests failed by an engine failure, by reason.", labelnames=["reason", *rl], registry=r)  # fmt: skip
        self.engine_memory = Gauge("tidal:engine_process_memory_bytes", "Resident memory of the engine process; 0 while none runs (or the engine runs in the server process).", labelnames=rl, registry=r)  # fmt: skip
        self.router_decisions = Counter("tidal:router_decisions", "Requests routed to each replica, by why (session, prefix, load, moved); data parallel only.", ["replica", "reason"], registry=r)  # fmt: skip
        self._process = psutil.Process(os.getpid())
        self._device_memory_bytes = device_memory_bytes
        self.process_memory.set_function(lambda: float(self._process.memory_info().rss))
        self.memory_fraction.set_function(self._memory_fraction)
        self._replicas = [ReplicaMetrics(self, i) for i in range(num_replicas)]

    def replica(self, index: int) -> ReplicaMetrics:
        """The metrics engine replica `index` feeds (0 is the only one without data parallel)."""
        return self._replicas[index]

    def watch_engine(self, engine_pid: Callable[[], int | None], replica: int = 0) -> None:
        """Report the RSS of the process `engine_pid()` names (None while no engine runs)."""
        self._replicas[replica].engine_pid = engine_pid

    def on_step(self, stats: StepStats) -> None:
        """The engine's on_step callback (engine thread); the single engine's."""
        self._replicas[0].on_step(stats)

    def _memory_fraction(self) -> float:
        # NOTE: torch only on a CUDA engine (in this process): the API process of a supervised
        # CPU server never imports it, not even to be scraped.
        if self._device_memory_bytes:
            try:
                import torch

                if torch.cuda.is_available():
                    return torch.cuda.memory_reserved() / self._device_memory_bytes
            except Exception:  # a failing probe must not break /metrics
                pass
        vm = psutil.virtual_memory()
        return (vm.total - vm.available) / vm.total

    def observe_slo(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """Judge one finished request against the configured targets (a request with one output
        token has no TPOT and meets that target)."""
        if not self.targets_s:
            return
        measured = {"ttft": ttft_s, "tpot": tpot_s}
        good = True
        for slo, target_s in self.targets_s.items():
            value = measured[slo]
            met = value is None and slo == "tpot" or value is not None and value <= target_s
            good = good and met
            counts = self._slo_counts[slo]
            counts[0 if met else 1] += 1
            self.slo_requests.labels(slo=slo, result="met" if met else "missed").inc()
            self.slo_attainment.labels(slo=slo).set(counts[0] / (counts[0] + counts[1]))
        if good:
            self.goodput.inc()

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Per served engine request: observes latencies from each delta output's engine timestamps."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self._last_token_time_s: float | None = None
        self._seen_first = False
        self._counted_prompt = False
        # For the request's log line: its counts and, once finished, the engine's timings
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_tokens = 0  # every choice's
        self.final: RequestMetrics | None = None

    def update(self, out: RequestDelta) -> None:
        m = self.m
        num_new = sum(len(c.token_ids) for c in out.outputs)
        self.num_output_tokens += num_new
        if num_new:
            m.generation_tokens.inc(num_new)
        if not self._counted_prompt:
            self._counted_prompt = True
            m.prompt_tokens.inc(out.num_prompt_tokens)
            self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            self.final = out.metrics
        # A delta carries metrics until its first token and when finished (RequestDelta).
        t = out.metrics
        if not self._seen_first and t is not None and t.first_token_time_s is not None:
            self._seen_first = True
            m.ttft.observe(max(0.0, t.first_token_time_s - t.arrival_time_s))
            if t.first_scheduled_time_s is not None:
                m.queue_time.observe(max(0.0, t.first_scheduled_time_s - t.arrival_time_s))
        elif num_new and out.last_token_time_s is not None and self._last_token_time_s is not None:
            # The gap a streaming client sees: one per step that brings tokens (one per choice,
            # or several with accepted drafts), as vLLM counts it per iteration.
            m.itl.observe(max(0.0, out.last_token_time_s - self._last_token_time_s))
        if out.last_token_time_s is not None:
            self._last_token_time_s = out.last_token_time_s
        if out.finished and t is not None and t.finished_time_s is not None:
            m.e2e.observe(max(0.0, t.finished_time_s - t.arrival_time_s))
            if t.first_token_time_s is not None:
                ttft_s = t.first_token_time_s - t.arrival_time_s
                tpot_s = None
                if t.num_generation_tokens > 1 and t.last_token_time_s is not None:
                    tpot_s = (t.last_token_time_s - t.first_token_time_s) / (
                        t.num_generation_tokens - 1
                    )
                m.observe_slo(ttft_s, tpot_s)

    def finish(self, reason: str) -> None:
        self.m.success.labels(finished_reason=reason).inc()

    def describe(self, reason: str) -> str:
        """The request's log line after its id: finish, tokens, then the engine's timings
        (those a finished request carries; an aborted or failed one has counts only)."""
        text = (
            f"{reason}; prompt {self.num_prompt_tokens} tokens ({self.num_cached_tokens} cached),"
            f" {self.num_output_tokens} output"
        )
        t = self.final
        if t is None or t.finished_time_s is None:
            return text
        parts = []
        if t.first_scheduled_time_s is not None:
            parts.append(f"queued {t.first_scheduled_time_s - t.arrival_time_s:.3f} s")
        if t.first_token_time_s is not None:
            parts.append(f"first token {t.first_token_time_s - t.arrival_time_s:.3f} s")
        parts.append(f"total {t.finished_time_s - t.arrival_time_s:.3f} s")
        after = (t.last_token_time_s or 0.0) - (t.first_token_time_s or 0.0)
        if t.num_generation_tokens > 1 and after > 0:
            parts.append(f"{(t.num_generation_tokens - 1) / after:.1f} tok/s after the first")
        if t.num_preemptions:
            parts.append(f"{t.num_preemptions} preemptions")
        return f"{text}; {', '.join(parts)}"
