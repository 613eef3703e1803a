"""ReplicaMetrics: the metrics one engine replica feeds (step stats, up/down, restarts, failures, memory), bound to its label."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil

from tidal.engine.stats import StepStats
from tidal.scheduler.cost_model import TERMS

if TYPE_CHECKING:
    from tidal.server.metrics import ServerMetrics


class ReplicaMetrics:
    """One replica's children of ServerMetrics' engine-fed families: `replica="<index>"` under
    data parallel, the unlabelled metrics themselves with one engine. Its methods are the
    engine client's hooks (`hook`)."""

    def __init__(self, m: ServerMetrics, index: int) -> None:
        labels = {"replica": str(index)} if m.num_replicas > 1 else {}
        self.labels = labels

        def bind(metric):  # the labelled child, or the metric itself
            return metric.labels(**labels) if labels else metric

        self._m = m
        self.index = index
        self.running = bind(m.running)
        self.waiting = bind(m.waiting)
        self.kv_usage = bind(m.kv_usage)
        self.prefix_queries = bind(m.prefix_queries)
        self.prefix_hits = bind(m.prefix_hits)
        self.preemptions = bind(m.preemptions)
        self.token_budget = bind(m.token_budget)
        self.prefill_budget = bind(m.prefill_budget)
        self.seat_cap = bind(m.seat_cap)
        self.headroom = bind(m.headroom)
        self.step_cost = {t: m.step_cost.labels(term=t, **labels) for t in TERMS}
        self.batch_utilization = bind(m.batch_utilization)
        self.seat_utilization = bind(m.seat_utilization)
        self.iteration_tokens = bind(m.iteration_tokens)
        self.step_duration = bind(m.step_duration)
        self.moe_expert_tokens = bind(m.moe_expert_tokens)
        self.moe_imbalance = bind(m.moe_imbalance)
        self.grammar_mask = bind(m.grammar_mask)
        self.draft_tokens = bind(m.draft_tokens)
        self.accepted_tokens = bind(m.accepted_tokens)
        self.step_predicted = bind(m.step_predicted)
        self.model_load = bind(m.model_load)
        self.engine_restarts = bind(m.engine_restarts)
        self.engine_up = bind(m.engine_up)
        self.engine_memory = bind(m.engine_memory)
        self.engine_pid: Callable[[], int | None] = lambda: None
        self._engine_process: psutil.Process | None = None
        self.engine_memory.set_function(self._engine_rss)

    def hook(self, engine) -> None:  # engine: tidal.client.engine_client.EngineClient
        """Feed these metrics from one engine client's hooks."""
        engine.on_step = self.on_step
        engine.on_up = lambda up: self.engine_up.set(1 if up else 0)
        engine.on_restart = self.engine_restarts.inc
        engine.on_request_failed = self.request_failed

    def request_failed(self, reason: str) -> None:
        self._m.requests_failed.labels(reason=reason, **self.labels).inc()

    def routed(self, reason: str) -> None:
        """The router sent a request here (router/policy.py REASONS)."""
        self._m.router_decisions.labels(replica=str(self.index), reason=reason).inc()

    def _engine_rss(self) -> float:
        # Read at scrape time only: one /proc read; the Process object is kept per pid.
        pid = self.engine_pid()
        if pid is None:
            return 0.0
        try:
            if self._engine_process is None or self._engine_process.pid != pid:
                self._engine_process = psutil.Process(pid)
            return float(self._engine_process.memory_info().rss)
        except psutil.Error:  # it died between the pid lookup and the read
            return 0.0

    def on_step(self, stats: StepStats) -> None:
        """The engine's on_step callback (engine thread: prometheus_client is thread-safe)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        if stats.prefix_queried_tokens:
            self.prefix_queries.inc(stats.prefix_queried_tokens)
        if stats.prefix_hit_tokens:
            self.prefix_hits.inc(stats.prefix_hit_tokens)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        self.token_budget.set(stats.token_budget)
        self.prefill_budget.set(stats.prefill_budget)
        self.seat_cap.set(stats.seat_cap)
        self.headroom.set(stats.headroom)
        for term, seconds in zip(TERMS, stats.cost_coefficients):
            self.step_cost[term].set(seconds)
        if stats.num_scheduled_tokens:  # idle bookkeeping steps would skew the histograms
            self.batch_utilization.observe(stats.batch_utilization)
            self.seat_utilization.observe(stats.seat_utilization)
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
            self.step_duration.observe(stats.step_time_s)
            self.step_predicted.observe(stats.predicted_step_s)
        if stats.num_constrained_seqs:
            self.grammar_mask.observe(stats.grammar_mask_s)
        if stats.num_draft_tokens:
            self.draft_tokens.inc(stats.num_draft_tokens)
            self.accepted_tokens.inc(stats.num_accepted_tokens)
        if stats.moe_expert_tokens and any(stats.moe_expert_tokens):
            for n in stats.moe_expert_tokens:
                self.moe_expert_tokens.observe(n)
            mean = sum(stats.moe_expert_tokens) / len(stats.moe_expert_tokens)
            self.moe_imbalance.set(max(stats.moe_expert_tokens) / mean)
