"""SchedulerStats: what one schedule() call did, for the engine's StepStats (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot taken at the end of schedule(); counts are for that step unless named total."""

    num_scheduled_tokens: int = 0
    token_budget: int = 0
    num_scheduled_seqs: int = 0
    num_decode_seqs: int = 0
    num_prefill_seqs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    num_finished_by_scheduler: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Set when window_ms held back the prefills this step: the clock time to schedule again.
    hold_until_s: float | None = None
    num_preemptions_total: int = 0
    # The batch controller's plan for this step (see scheduler/controller.py).
    seat_cap: int = 0
    prefill_budget: int = 0
    budget_reason: str = "fixed"
    # This step's shape as the cost model sees it, and the model's prediction of its time.
    num_prefill_tokens: int = 0
    attended_keys: int = 0
    predicted_step_s: float = 0.0
    # The cost model's coefficients in cost_model.TERMS order, and the controller's headroom.
    cost_coefficients: tuple[float, ...] = ()
    headroom: float = 1.0
