"""SchedulerConfig: how many sequences and tokens one step may hold, the latency targets, and the queue policy."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config._check import check


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Most sequences in one step's batch (with target_tpot_ms, the upper bound of the seat cap).
    max_num_seqs: int = 32
    # With target_tpot_ms, the seat cap never goes below this many sequences (nor above
    # max_num_seqs: with max_num_seqs=2 the floor is 2). The seeds' min_batch is 4 too: fewer
    # seats rarely lower the step time enough to be worth the lost throughput.
    min_num_seqs: int = 4
    # Most tokens one step may hold (decodes count 1 each; prefill chunks fill the rest). Without
    # a target on a GPU this is every step's budget; otherwise it is the ceiling of the budget.
    max_num_batched_tokens: int = 1024
    # Aim each decode step at this time per output token: the batch controller sizes every step's
    # prefill budget and the running-sequence cap from the learned step cost model. None: no target.
    target_tpot_ms: float | None = None
    # Raise the prefill share when a request waiting for its first token would miss this. None: none.
    target_ttft_ms: float | None = None
    # Without target_tpot_ms on a CPU: the budget is the prefill that fits a step of this length
    # (a 1024-token chunk takes ~2 s on 2 cores and stalls every decode beside it). None (the
    # default): the fixed max_num_batched_tokens, which served 1.4-1.7x the output tokens of 300
    # ms steps at saturation, with lower p99 TTFT and mean TPOT (benchmarks/README.md): each
    # step pays a fixed cost (every GGUF weight decoded for the prompt rows, the decodes' LM
    # head rows) that small chunks repeat.
    cpu_budget_step_ms: float | None = None
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
    # Prompt-lookup (n-gram) speculative decoding: a decoding request whose last tokens occurred
    # earlier in its prompt or output proposes the tokens that followed them there, up to this
    # many; one step checks them all (their rows cost little beside the weights a step reads
    # anyway) and keeps the ones the model agrees with. 0: off. Outputs are the same as without
    # (greedy and seeded alike).
    num_speculative_tokens: int = 4
    # The longest and shortest suffix looked up (longest first): a longer match predicts better,
    # a shorter one matches more often.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Drafts only in steps with at most this many decoding sequences (which ones, and how many
    # tokens each, is DraftPlanner's choice: by each sequence's recent acceptance against the
    # step cost below); more would hold a lookup index each for little gain.
    speculative_max_num_seqs: int = 16
    # A decode step's fixed cost (reading every weight) in rows of the batch: a draft is checked
    # where its chance of being kept is worth a row at that price (DraftPlanner). On 2 Xeon cores
    # with the bundled model, a 16-sequence step took ~28 ms and each further row ~1 ms (~12 rows
    # of fixed cost); 8 is on the cautious side of that. A GPU hides many more rows behind its
    # reads.
    speculative_step_rows: float = 8.0

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "an integer >= 1")
        check(self.min_num_seqs >= 1, "min_num_seqs", self.min_num_seqs, "an integer >= 1")
        for name in ("target_tpot_ms", "target_ttft_ms", "cpu_budget_step_ms"):
            value = getattr(self, name)
            # `not > 0` also refuses NaN, which no measured time would ever compare above.
            check(
                value is None or value > 0, name, value, "a positive number of milliseconds or None"
            )
        check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "an integer >= 1",
        )
        check(
            self.max_queue is None or self.max_queue >= 1,
            "max_queue",
            self.max_queue,
            "an integer >= 1 or None",
        )
        check(self.window_ms >= 0, "window_ms", self.window_ms, "a number >= 0")
        check(
            self.priority_aging_s > 0,
            "priority_aging_s",
            self.priority_aging_s,
            "a positive number of seconds",
        )
        check(
            self.num_speculative_tokens >= 0,
            "num_speculative_tokens",
            self.num_speculative_tokens,
            "an integer >= 0 (0: off)",
        )
        check(
            self.speculative_max_num_seqs >= 1,
            "speculative_max_num_seqs",
            self.speculative_max_num_seqs,
            "an integer >= 1",
        )
        check(
            self.speculative_step_rows > 0,
            "speculative_step_rows",
            self.speculative_step_rows,
            "a number of rows > 0",
        )
        check(
            self.prompt_lookup_min >= 1,
            "prompt_lookup_min",
            self.prompt_lookup_min,
            "an integer >= 1",
        )
        check(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            self.prompt_lookup_max,
            f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})",
        )
        check(
            self.length_aging_tokens_per_s >= 0,
            "length_aging_tokens_per_s",
            self.length_aging_tokens_per_s,
            "a number >= 0",
        )
