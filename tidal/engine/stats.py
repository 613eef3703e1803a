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
    # running / seat cap: how full the step's sequence seats were (a decode-only step fills few
    # tokens of its budget yet may hold every seat).
    seat_utilization: float
    # The batch controller's plan: the running-sequence cap, the prefill share of the budget,
    # and why ("fixed", "auto", "tpot", "ttft"; see scheduler/controller.py).
    seat_cap: int
    prefill_budget: int
    budget_reason: str
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
    # The cost model's prediction of this step's time, and its features (scheduler/cost_model.py).
    predicted_step_s: float
    num_prefill_tokens: int
    attended_keys: int
    # The cost model's coefficients (seconds per unit, cost_model.TERMS order) this step was planned with.
    cost_coefficients: tuple[float, ...]
    # The controller's headroom (its hysteresis state; 1.0 unless a TPOT target corrected it).
    headroom: float
    # MoE models: tokens routed to each expert this step, summed over the sparse layers (empty
    # for dense models); /metrics turns it into the expert-load histogram.
    moe_expert_tokens: tuple[int, ...] = ()
    # Constrained decoding: rows that sampled under a grammar mask this step, and the seconds
    # their masks took (computed beside the forward, so not all of it adds to step_time_s).
    num_constrained_seqs: int = 0
    grammar_mask_s: float = 0.0
    # Prompt-lookup speculative decoding: draft tokens checked this step, and how many the model
    # agreed with (each accepted draft is an output token its step did not have to decode alone).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @staticmethod
    def from_step(
        s: SchedulerStats,
        sched: SchedulerOutput,
        step_time_s: float,
        kv: KVCacheManager,
        moe_expert_tokens: tuple[int, ...] = (),
        num_constrained_seqs: int = 0,
        grammar_mask_s: float = 0.0,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
    ) -> StepStats:
        budget = max(1, s.token_budget)
        return StepStats(
            num_scheduled_tokens=sched.num_batched_tokens,
            token_budget=s.token_budget,
            batch_utilization=min(1.0, sched.num_batched_tokens / budget),
            seat_utilization=min(1.0, s.num_running / max(1, s.seat_cap)),
            seat_cap=s.seat_cap,
            prefill_budget=s.prefill_budget,
            budget_reason=s.budget_reason,
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
            predicted_step_s=s.predicted_step_s,
            num_prefill_tokens=s.num_prefill_tokens,
            attended_keys=s.attended_keys,
            cost_coefficients=s.cost_coefficients,
            headroom=s.headroom,
            moe_expert_tokens=moe_expert_tokens,
            num_constrained_seqs=num_constrained_seqs,
            grammar_mask_s=grammar_mask_s,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
        )
