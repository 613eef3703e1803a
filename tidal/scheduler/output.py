"""SchedulerOutput: the one thing the scheduler hands the model runner each step (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of this step."""

    # The request itself: its sampling params, prompt and outputs so far (read-only to the runner).
    request: Request
    # Positions [start, start + num_tokens) of request.all_token_ids are computed this step.
    start: int
    # How many tokens are computed this step (a prefill chunk, or 1 for a decode).
    num_tokens: int
    # Per KV group, the request's block table covering positions [0, start + num_tokens); entries of
    # sliding groups whose tokens fell out of the window hold the null block 0.
    block_tables: list[list[int]]
    # Whether this step reaches the end of the known tokens, so the last position is sampled.
    sample: bool
    # Whether logits of the computed prompt positions are needed (prompt logprobs / echo scoring).
    want_prompt_logprobs: bool = False
    # A decode's guessed next tokens (prompt lookup), computed after its last known token: the
    # step computes 1 + len(draft) positions, samples each, and keeps the drafts up to the first
    # the model disagrees with, plus the model's own token there.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """What runs this step. Decodes come first in `scheduled`, then prefill chunks."""

    # Requests computed this step, in batch order.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Sum of num_tokens over `scheduled`; at most the step's token budget.
    num_batched_tokens: int = 0
    # The token budget of this step (max_num_batched_tokens), for batch-utilization stats.
    token_budget: int = 0
    # Requests preempted this step (their KV was freed; they will be recomputed).
    preempted_ids: list[str] = field(default_factory=list)
    # Requests finished by the scheduler itself this step (deadline, rejected), with their status set.
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
