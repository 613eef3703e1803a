"""StepStats: one plain snapshot per engine step, read by metrics, logs and the on_step callback."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.kv.manager import KVCacheManager
from tidal.scheduler.output import SchedulerOutput
from tidal.scheduler.stats import SchedulerStats


@dataclass(frozen=True, slots=True)
class StepStats:
    num_scheduled_tokens: int
    token_budget: int
    # scheduled / budget: how full the step's token budget was (the seeds' batch-utilization monitor).
    batch_utilization: float
    num_scheduled_seqs: int
    num_decode_seqs: int
    num_prefill_seqs: int
    num_running: int
    num_waiting: int
    num_preempted: int  # preempted in this step
    num_preemptions_total: int
    kv_usage: float
    num_free_blocks: int
    prefix_queried_tokens: int  # this step
    prefix_hit_tokens: int  # this step
    prefix_queried_tokens_total: int
    prefix_hit_tokens_total: int
    evictions_by_reason: tuple[tuple[str, int], ...]
    step_time_s: float

    @staticmethod
    def from_step(
        s: SchedulerStats, sched: SchedulerOutput, step_time_s: float, kv: KVCacheManager
    ) -> StepStats:
        budget = max(1, s.token_budget)
        return StepStats(
            num_scheduled_tokens=sched.num_batched_tokens,
            token_budget=s.token_budget,
            batch_utilization=min(1.0, sched.num_batched_tokens / budget),
            num_scheduled_seqs=s.num_scheduled_seqs,
            num_decode_seqs=s.num_decode_seqs,
            num_prefill_seqs=s.num_prefill_seqs,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_preempted=s.num_preempted,
            num_preemptions_total=s.num_preemptions_total,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_queried_tokens=s.prefix_queried_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_queried_tokens_total=kv.prefix_queried_tokens,
            prefix_hit_tokens_total=kv.prefix_hit_tokens,
            evictions_by_reason=tuple(sorted(kv.evictions_by_reason.items())),
            step_time_s=step_time_s,
        )
