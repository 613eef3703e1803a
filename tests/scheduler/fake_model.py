"""A tiny paged "model" for scheduler tests: it stores token ids as KV and reads them back."""

from __future__ import annotations

from tidal.kv.layout import KVLayout
from tidal.request import Request
from tidal.scheduler.output import SchedulerOutput
from tidal.scheduler.scheduler import Scheduler


def next_token(context: list[int]) -> int:
    """The fake model's greedy choice: depends on the last token and the whole context."""
    return (context[-1] * 7 + 3 + sum(context)) % 100


class PagedFakeModel:
    """Writes each computed token id into its KV slot through the block tables, then samples
    from the ids it reads back. A wrong table (a null block in the window, a block shared while
    another request overwrote it, a stale prefix hit) reads wrong ids and fails loudly.

    A decode with drafts writes them after its last token and samples after each, keeping the
    drafts up to the first the model disagrees with (as the runner does): a rejected draft's
    stale KV that a later step read without recomputing fails the same way."""

    def __init__(self, layout: KVLayout, next_token=next_token) -> None:  # type: ignore[no-untyped-def]
        self.layout = layout
        self.next_token = next_token
        self.pages: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id
        self.num_draft_tokens = self.num_accepted_tokens = 0

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        bs = self.layout.block_size
        sampled: dict[str, list[int]] = {}
        for s in output.scheduled:  # in batch order: writers before readers
            draft = s.draft_token_ids
            tokens = s.request.all_token_ids + draft
            end = s.start + s.num_tokens
            for g, spec in enumerate(self.layout.groups):
                table = s.block_tables[g]
                assert len(table) >= -(-end // bs), (s.request.request_id, g, table)
                for pos in range(s.start, end):
                    assert table[pos // bs] != 0, f"write of position {pos} into the null block"
                    self.pages[(table[pos // bs], pos % bs)] = tokens[pos]
                for q in range(s.start, end):  # every query reads its visible keys back
                    lo = 0 if spec.sliding_window is None else max(0, q - spec.sliding_window + 1)
                    for pos in range(lo, q + 1):
                        block = table[pos // bs]
                        assert block != 0, f"query {q} needs key {pos}, in a null block"
                        assert self.pages[(block, pos % bs)] == tokens[pos], (
                            s.request.request_id,
                            g,
                            q,
                            pos,
                        )
            if s.sample:
                known = end - len(draft)
                out = [self.next_token(tokens[:known])]
                for i, d in enumerate(draft):
                    if out[-1] != d:
                        break
                    out.append(self.next_token(tokens[: known + i + 1]))
                sampled[s.request.request_id] = out
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += len(out) - 1
        return sampled


def reference_output(request: Request, next_token=next_token) -> list[int]:  # type: ignore[no-untyped-def]
    """What the fake model produces for a request alone, computed without any KV at all."""
    tokens = list(request.prompt_token_ids)
    max_tokens = request.sampling_params.max_tokens
    assert max_tokens is not None
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[request.num_prompt_tokens :]


def run_to_completion(
    scheduler: Scheduler, model: PagedFakeModel, max_steps: int = 10_000
) -> list[SchedulerOutput]:
    """Step until nothing is unfinished, checking the per-step limits; returns every output."""
    outputs = []
    config = scheduler.config
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        out = scheduler.schedule()
        assert len(out.scheduled) <= config.max_num_seqs
        assert out.num_batched_tokens <= config.max_num_batched_tokens or len(out.scheduled) == 1
        scheduler.update_from_output(out, model.execute(out))
        outputs.append(out)
    raise AssertionError(f"not finished after {max_steps} steps")
