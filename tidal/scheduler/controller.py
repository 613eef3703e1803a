"""BatchController: each step's token budget and running-sequence cap, from the step cost model and targets."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tidal.config.scheduler import SchedulerConfig
from tidal.scheduler.cost_model import StepCostModel, StepShape

# A step always has room for this many prefill tokens, so waiting prompts progress even when
# the decodes alone already cost the whole target (the seat cap then stops admitting more).
MIN_PREFILL_TOKENS = 32
# Chunks smaller than this cost ~1.7x more per token on a CPU (measured on the bundled model:
# 5.0 ms/token at 32, 3.6 at 64, 2.9 at 512, one thread). With a TPOT target, when no larger
# chunk fits and decode-only steps are cheap, the step decodes only and banks the difference
# (see _slack_s), so a few steps later a bigger chunk fits.
MIN_EFFICIENT_CHUNK = 64
# Seed-style hysteresis on the measured decode-step time: above SHRINK_ABOVE x target the time
# the controller plans for shrinks by SHRINK_BY; below GROW_BELOW x target, on a step the budget
# limited, it grows by GROW_BY. Between the two nothing moves, so noise does not make it hunt.
SHRINK_ABOVE, GROW_BELOW = 1.2, 0.8
SHRINK_BY, GROW_BY = 0.9, 1.05
HEADROOM_MIN, HEADROOM_MAX = 0.5, 1.5
# Smoothing of the measured decode-step time that the hysteresis reads.
EMA_ALPHA = 0.3
# The context a sequence not yet decoding is assumed to bring when sizing the seat cap.
NEW_SEQ_KEYS = 1024
# TPOT is a request's mean time per output token, so a decode step may run longer than the
# target when every decoding request has banked the difference: its tokens so far came faster
# than the target. The bank counts the tokens so far plus at most this many ahead (assumed to
# take a decode-only step each): a request that stops early (EOS) was promised little.
SLACK_HORIZON_TOKENS = 8


@dataclass(frozen=True, slots=True)
class StepLoad:
    """What the scheduler knows before it builds a step (no request objects)."""

    num_decodes: int  # running requests that will compute one token this step
    decode_keys: int  # keys those decodes attend (their context lengths)
    num_running: int
    # Per decoding request (TPOT target only): (output tokens after its first, seconds since its
    # first token, output tokens it may still produce).
    decoding: tuple[tuple[int, float, int], ...] = ()
    # Tokens already computed of the running prefill served first (its next chunk attends them).
    prefill_start: int = 0
    # (seconds since arrival, prefill tokens left) of each request with no first token yet, in
    # the order the scheduler serves them (running prefills first, then the waiting queue).
    pending_first_tokens: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The controller's decision for one step."""

    # Tokens the step may hold: every decode plus `prefill_tokens` (never above the ceiling).
    token_budget: int
    # Most running sequences; admission stops at this many (running ones are never preempted).
    max_num_seqs: int
    # Of the budget, how many tokens prefill chunks may take.
    prefill_tokens: int
    # Why: "fixed" (no target: max_num_batched_tokens), "auto" (CPU, no target: the tokens that
    # fit cpu_budget_step_ms), "tpot" (the tokens that fit the TPOT target), "ttft" (raised so
    # queued requests meet the TTFT target), "tpot-slack" (longer than the TPOT target: every
    # decoding request's mean stays within it, see SLACK_HORIZON_TOKENS), "no-decodes" (nothing
    # decoding: max_num_batched_tokens, with or without a target), "tpot-bank" (decodes only: no
    # efficient chunk fits, the decodes bank slack for a bigger one).
    reason: str
    # The step time the plan aims at (0.0 for "fixed").
    planned_s: float = 0.0


class BatchController:
    """Sizes each step so decode steps meet target_tpot_ms while prompts are admitted as fast
    as that allows; a pure function of the step statistics it has observed (no clock, no I/O).

    With target_tpot_ms the step may take `target x headroom`: the decodes' predicted time
    first, prefill chunks in what remains. `headroom` starts at 1 and is the hysteresis state:
    it corrects a cost model that is off (the measured time, not the prediction, is the target).
    TPOT is a request's mean, so the step may take longer while every decoding request has
    banked slack (_slack_s), and decodes alone when only an inefficient chunk would fit.
    With target_ttft_ms the prefill share rises when, at the planned rate, a request still
    waiting for its first token would miss the target. Without targets on a CPU, when
    cpu_budget_step_ms is set, the budget is what fits it while anything decodes; by default,
    elsewhere, and in steps without decodes, it is max_num_batched_tokens.
    """

    def __init__(
        self, config: SchedulerConfig, on_cpu: bool = False, model: StepCostModel | None = None
    ) -> None:
        self.config = config
        self.model = model or StepCostModel()
        if config.target_tpot_ms is not None:
            self.mode = "tpot"
        elif on_cpu and config.cpu_budget_step_ms is not None and config.enable_chunked_prefill:
            self.mode = "auto"
        else:
            self.mode = "fixed"
        self.headroom = 1.0
        self.measured_decode_s: float | None = None  # EMA of decode-step times (tpot mode)

    def plan(self, load: StepLoad) -> StepPlan:
        cfg = self.config
        ceiling = cfg.max_num_batched_tokens
        if self.mode == "fixed":
            return StepPlan(ceiling, cfg.max_num_seqs, ceiling - load.num_decodes, "fixed")
        seats = self._seat_cap(load) if self.mode == "tpot" else cfg.max_num_seqs
        if load.num_decodes == 0:
            # Nobody decodes: this step's length is nobody's TPOT, only the prompts' TTFT, and
            # bigger chunks prefill faster (each chunk of a GGUF-block prefill decodes every
            # weight again; 512 tokens in 300 ms chunks took 0.7x the time of one step here).
            # The next step, with decodes, is sized to the target or the CPU budget.
            return StepPlan(ceiling, seats, ceiling, "no-decodes")
        reason = self.mode
        if self.mode == "tpot":
            step_s = cfg.target_tpot_ms / 1000 * self.headroom  # type: ignore[operator]
            slack_s = self._slack_s(load)
            if slack_s > step_s:
                step_s, reason = slack_s, "tpot-slack"
        else:
            step_s = cfg.cpu_budget_step_ms / 1000  # type: ignore[operator]
        prefill = self.model.prefill_tokens_within(
            step_s, load.num_decodes, load.decode_keys, load.prefill_start
        )
        if cfg.target_ttft_ms is not None:
            needed = self._ttft_tokens(load, step_s)
            if needed > prefill:
                prefill, reason = needed, "ttft"
        banking = self.mode == "tpot" and reason != "ttft" and load.decoding
        if banking and prefill < MIN_EFFICIENT_CHUNK:
            decode_s = self.model.predict_s(StepShape(0, load.num_decodes, load.decode_keys))
            target_s = cfg.target_tpot_ms / 1000 * self.headroom  # type: ignore[operator]
            if decode_s < target_s / 2:  # each decode-only step banks at least half a target
                return StepPlan(load.num_decodes, seats, 0, "tpot-bank", step_s)
        prefill = min(max(prefill, MIN_PREFILL_TOKENS), ceiling - load.num_decodes)
        return StepPlan(load.num_decodes + prefill, seats, prefill, reason, step_s)

    def observe(self, shape: StepShape, step_s: float, plan: StepPlan, filled: bool) -> None:
        """Learn from one executed step. `filled`: the step used its whole budget or every seat
        while work waited, so a longer planned step would have been used."""
        self.model.observe(shape, step_s)
        if self.mode != "tpot" or shape.num_decode_seqs == 0 or plan.reason != "tpot":
            return  # only decode steps sized by the TPOT target speak to the target
        target_s = self.config.target_tpot_ms / 1000  # type: ignore[operator]
        if not filled and step_s <= target_s:
            return  # light because there was little work, not because the plan was short
        prev = self.measured_decode_s
        ema = step_s if prev is None else prev + EMA_ALPHA * (step_s - prev)
        self.measured_decode_s = ema
        floor = min(self.config.min_num_seqs, self.config.max_num_seqs)
        can_shrink = plan.prefill_tokens > MIN_PREFILL_TOKENS or plan.max_num_seqs > floor
        if ema > SHRINK_ABOVE * target_s:
            if can_shrink:  # at the minimum chunk and seat floor, shrinking only loses throughput
                self.headroom = max(HEADROOM_MIN, self.headroom * SHRINK_BY)
        elif ema < GROW_BELOW * target_s and filled:
            self.headroom = min(HEADROOM_MAX, self.headroom * GROW_BY)

    def _slack_s(self, load: StepLoad) -> float:
        """The longest step that keeps every decoding request's TPOT (mean seconds per output
        token after the first) within the target:

            k tokens after the first in e seconds so far, this step s, then h - 1 decode-only
            steps of d each (h = min(tokens left, SLACK_HORIZON_TOKENS)):
                (e + s + (h - 1) d) / (k + h) <= target
            =>  s <= target (k + h) - e - (h - 1) d

        0.0 when nothing decodes or a request has no token left to bank on."""
        if not load.decoding:
            return 0.0
        target_s = self.config.target_tpot_ms / 1000 * self.headroom  # type: ignore[operator]
        d = self.model.predict_s(StepShape(0, load.num_decodes, load.decode_keys))
        slack = math.inf
        for k, elapsed_s, left in load.decoding:
            h = min(left, SLACK_HORIZON_TOKENS)
            if h <= 0:
                return 0.0
            slack = min(slack, target_s * (k + h) - elapsed_s - (h - 1) * d)
        return max(0.0, slack)

    def _ttft_tokens(self, load: StepLoad, step_s: float) -> int:
        """Prefill tokens per step that let every pending request that can still meet the TTFT
        target meet it: the k-th in line needs the tokens of all before it done in time."""
        target_s = self.config.target_ttft_ms / 1000  # type: ignore[operator]
        needed = cumulative = 0
        for waited_s, tokens in load.pending_first_tokens:
            cumulative += tokens
            left_s = target_s - waited_s
            if left_s <= 0:
                continue  # already missed: raising the share now only costs everyone's TPOT
            steps = max(1, int(left_s / step_s + 1e-9))  # 0.6 / 0.1 is 5.999...
            needed = max(needed, math.ceil(cumulative / steps))
        return needed

    def _seat_cap(self, load: StepLoad) -> int:
        """Most sequences whose decodes, with a minimal prefill chunk, fit the planned step."""
        cfg = self.config
        step_s = cfg.target_tpot_ms / 1000 * self.headroom  # type: ignore[operator]
        c = self.model.coefficients
        per_seq_keys = load.decode_keys / load.num_decodes if load.num_decodes else NEW_SEQ_KEYS
        per_seq_s = c[2] + c[3] * per_seq_keys / 1000
        room_s = step_s - c[0] - c[1] * MIN_PREFILL_TOKENS
        seats = cfg.max_num_seqs if per_seq_s <= 0 else int(room_s / per_seq_s)
        return max(min(cfg.min_num_seqs, cfg.max_num_seqs), min(cfg.max_num_seqs, seats))
