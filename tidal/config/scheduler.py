"""SchedulerConfig: how many sequences and tokens one step may hold, and the queue policy."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config._check import check


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Most sequences in one step's batch.
    max_num_seqs: int = 32
    # Token budget of one step (decodes count 1 each; prefill chunks fill the rest).
    max_num_batched_tokens: int = 1024
    # Split prompts longer than the remaining budget across steps, mixed with decodes.
    enable_chunked_prefill: bool = True
    # Waiting requests beyond this are rejected (finish reason "rejected"); None is unbounded.
    max_queue: int | None = 1024
    # When idle, wait up to this long to gather prefills into one step (the seeds' min_batch_delay).
    window_ms: float = 0.0
    # A waiting request gains one priority level per this many seconds waited, so none starves.
    priority_aging_s: float = 10.0
    # Among prefills of one level, shorter uncached work goes first; one second of waiting is
    # worth this many tokens of length, so long prompts are not starved.
    length_aging_tokens_per_s: float = 512.0

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "an integer >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, "an integer >= 1")
        check(self.max_queue is None or self.max_queue >= 1, "max_queue", self.max_queue, "an integer >= 1 or None")
        check(self.window_ms >= 0, "window_ms", self.window_ms, "a number >= 0")
        check(self.priority_aging_s > 0, "priority_aging_s", self.priority_aging_s, "a positive number of seconds")
        check(self.length_aging_tokens_per_s >= 0, "length_aging_tokens_per_s", self.length_aging_tokens_per_s, "a number >= 0")
