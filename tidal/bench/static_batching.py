"""StaticBatcher: a benchmark baseline that runs tidal's engine on a static-batching schedule."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

# The engine settings that make the schedule static; StaticBatcher sets them and refuses them from
# its caller, so no setting it accepts is silently overridden.
_STATIC_SETTINGS = (
    "max_num_seqs",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "cpu_budget_step_ms",
    "target_tpot_ms",
    "target_ttft_ms",
    "on_step",
)
# Default step budget: the whole batch's prompts are prefilled in one step, as a static batcher's
# one (B, L) forward does. The engine also needs it >= the model's context when chunking is off.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1 << 16


@dataclass(slots=True)
class StaticResult:
    """One request's greedy tokens and times on the batcher's clock (seconds)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    first_token_time_s: float  # the batch's prefill ended
    finished_time_s: float  # this row produced its last token (its slot stays busy after that)
    batch_end_time_s: float  # the whole batch ended; the next batch starts no earlier


class StaticBatcher:
    """BENCHMARK BASELINE, not a serving path: tidal's own engine, driven through the public
    `tidal.LLM` API on a static schedule, so that comparing it with `tidal.LLM` isolates the
    scheduling policy (same model, kernels and KV cache; only the schedule differs).

    What a static batcher does, and this one copies on purpose:
      - take up to `batch_size` requests in arrival order and admit nothing new until the batch
        ends: one `LLM.generate` call per batch;
      - prefill the whole batch in one step (no chunked prefill, a step budget that holds every
        prompt of the batch) and decode all rows together;
      - keep every row running until EVERY row is done: finished rows keep their slot and keep
        computing a token each step. Each row is asked for the batch's largest max_tokens with
        EOS ignored, and its output is cut at its own stop afterwards, so its greedy tokens are
        exactly what tidal returns for it alone;
      - reuse nothing between batches (no prefix cache).

    What it does not copy: padding the prompts to the longest one. The engine packs the batch's
    prompts, so the baseline is not charged for a padded (B, L_max) prefill; that favours it.

    Only greedy decoding is supported: the baseline measures throughput, not sampling.
    """

    def __init__(
        self,
        model: str | None,
        batch_size: int,
        *,
        eos_token_ids: Collection[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        **llm_kwargs: Any,
    ) -> None:
        """`model` and `llm_kwargs` go to `tidal.LLM` (dtype, threads, kv_cache_bytes,
        block_size, max_num_batched_tokens, ...). `eos_token_ids` None: the tokenizer's."""
        from tidal import LLM

        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid: expected an integer >= 1")
        taken = sorted(set(llm_kwargs) & set(_STATIC_SETTINGS))
        if taken:
            raise ValueError(
                f"StaticBatcher got {', '.join(taken)}: the static schedule sets "
                f"{', '.join(_STATIC_SETTINGS)} itself"
            )
        llm_kwargs.setdefault("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        self.batch_size = batch_size
        self.clock = clock
        self._steps: list[tuple[float, int, int]] = []  # (clock, prefill seqs, decode seqs)
        self.llm = LLM(
            model,
            on_step=self._on_step,
            max_num_seqs=batch_size,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            cpu_budget_step_ms=None,  # a fixed budget: the step holds the whole batch's prefill
            num_speculative_tokens=0,  # one token per sequence a step, in lockstep
            **llm_kwargs,
        )
        self.max_num_batched_tokens: int = llm_kwargs["max_num_batched_tokens"]
        tok = self.llm.get_tokenizer()
        self.eos_token_ids = frozenset(
            tok.eos_token_ids if eos_token_ids is None else eos_token_ids
        )

    def _on_step(self, stats: Any) -> None:
        self._steps.append((self.clock(), stats.num_prefill_seqs, stats.num_decode_seqs))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        *,
        ignore_eos: bool = False,
    ) -> list[StaticResult]:
        """Greedy outputs for every prompt, batch after batch, results in prompt order."""
        if len(prompts) != len(max_tokens):
            raise ValueError(f"got {len(max_tokens)} max_tokens for {len(prompts)} prompts")
        if any(not p for p in prompts):
            raise ValueError("prompt is empty: expected at least one token")
        if any(m < 1 for m in max_tokens):
            raise ValueError(f"max_tokens={list(max_tokens)!r} is invalid: expected integers >= 1")
        batches = [
            range(s, min(s + self.batch_size, len(prompts)))
            for s in range(0, len(prompts), self.batch_size)
        ]
        for b in batches:
            # One step prefills the whole batch, or the schedule would not be static.
            need = sum(len(prompts[i]) for i in b)
            if need > self.max_num_batched_tokens:
                raise ValueError(
                    f"a batch's prompts have {need} tokens: expected at most "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}); pass a larger one"
                )
        results: list[StaticResult] = []
        for b in batches:
            results.extend(
                self._run_batch(
                    [list(prompts[i]) for i in b], [max_tokens[i] for i in b], ignore_eos
                )
            )
        return results

    def _run_batch(
        self, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool
    ) -> list[StaticResult]:
        from tidal import SamplingParams

        num_rows, longest = len(prompts), max(max_tokens)
        # Every row runs as long as the longest: a finished row keeps its slot and computes.
        params = SamplingParams(temperature=0.0, max_tokens=longest, ignore_eos=True)
        self._steps.clear()
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params)
        end = self.clock()
        steps = self._steps[:]
        for prompt, out in zip(prompts, outs):
            got = len(out.outputs[0].token_ids)
            if got < longest:  # EOS is ignored: only the context limit ends a row early
                raise ValueError(
                    f"a batch needs {len(prompt) + longest} positions: expected at most the "
                    f"context length {len(prompt) + got}"
                )
        # Static means lockstep: step 0 prefills every row, each later step decodes every row
        # once. Then a row's k-th token came out of step k - 1; anything else (a preemption for
        # want of KV blocks, a prefill split over steps) would make the times below wrong.
        lockstep = (
            len(steps) == longest
            and steps[0][1:] == (num_rows, 0)
            and all(s[1:] == (0, num_rows) for s in steps[1:])
        )
        if not lockstep:
            raise RuntimeError(
                f"the engine did not run the batch of {num_rows} in lockstep (steps "
                f"(prefill, decode) seqs: {[s[1:] for s in steps]}): give it more KV cache "
                "(kv_cache_bytes) or a larger max_num_batched_tokens"
            )
        results = []
        for prompt, limit, out in zip(prompts, max_tokens, outs):
            tokens = list(out.outputs[0].token_ids)[:limit]
            if not ignore_eos:
                stop = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)
                if stop is not None:
                    tokens = tokens[: stop + 1]  # the stop token is returned, as tidal does
            results.append(
                StaticResult(prompt, tokens, steps[0][0], steps[len(tokens) - 1][0], end)
            )
        return results
