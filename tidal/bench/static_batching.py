"""StaticBatcher: a benchmark baseline that runs tidal's model the way a static batcher does."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from tidal.attention.metadata import build_metadata
from tidal.config.arch import ArchConfig
from tidal.kv.layout import KVLayout
from tidal.worker.kv_cache import allocate_kv_caches


@dataclass(slots=True)
class StaticResult:
    """One request's greedy tokens and times on the batcher's clock (seconds)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    first_token_time_s: float  # the batch's prefill ended
    finished_time_s: float  # this row produced its last token (its slot stays busy after that)
    batch_end_time_s: float  # the whole batch ended; the next batch starts no earlier


class StaticBatcher:
    """BENCHMARK BASELINE, not a serving path: static batching over tidal's own model and weights,
    so that comparing it with `tidal.LLM` isolates the scheduling policy.

    What a static batcher does, and this one copies on purpose:
      - take up to `batch_size` requests in arrival order; admit nothing new until the batch ends;
      - pad every prompt to the batch's longest one and prefill the whole (B, L_max) rectangle in
        one step, so padded positions cost compute;
      - decode all B rows together until EVERY row is done; finished rows keep their slot and keep
        computing a padding token each step.

    Padding is on the right with per-row lengths: row i's real prompt sits at positions 0..n_i-1
    and its padding after it, so causal attention never lets a real token see padding; the first
    token is read from position n_i - 1, and decode writes position n_i + t over the padding's K/V.
    That keeps greedy outputs equal to tidal's while the padded work is still done.

    Only greedy decoding (argmax) is supported: the baseline measures throughput, not sampling.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        arch: ArchConfig,
        batch_size: int,
        *,
        block_size: int = 16,
        pad_token_id: int = 0,
        eos_token_ids: Collection[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid: expected an integer >= 1")
        self.model = model
        self.arch = arch
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layout = KVLayout.from_layer_windows(
            arch.layer_windows(),
            block_size=block_size,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            dtype_bytes=self.dtype.itemsize,
        )

    @torch.inference_mode()
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
        if not prompts:
            return []
        batches = [
            range(s, min(s + self.batch_size, len(prompts)))
            for s in range(0, len(prompts), self.batch_size)
        ]
        longest = max(
            max(len(prompts[i]) for i in b) + max(max_tokens[i] for i in b) for b in batches
        )
        if longest > self.arch.max_position_embeddings:
            raise ValueError(
                f"a batch needs {longest} positions: expected at most the context length "
                f"{self.arch.max_position_embeddings}"
            )
        # One pool for the largest batch, reused: every (row, group) owns a contiguous run of ids.
        bs = self.layout.block_size
        blocks_per_row = -(-longest // bs)
        num_groups = len(self.layout.groups)
        kv = allocate_kv_caches(
            self.layout, 1 + self.batch_size * num_groups * blocks_per_row, self.dtype, self.device
        )
        tables = [
            [
                [1 + (r * num_groups + g) * blocks_per_row + b for b in range(blocks_per_row)]
                for g in range(num_groups)
            ]
            for r in range(self.batch_size)
        ]
        results: list[StaticResult | None] = [None] * len(prompts)
        for batch in batches:
            rows = [list(prompts[i]) for i in batch]
            for i, res in zip(
                batch, self._run_batch(rows, [max_tokens[i] for i in batch], tables, kv, ignore_eos)
            ):
                results[i] = res
        return results  # type: ignore[return-value]

    def _run_batch(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        tables: list[list[list[int]]],
        kv: list,
        ignore_eos: bool,
    ) -> list[StaticResult]:
        num_rows = len(prompts)
        lens = [len(p) for p in prompts]
        width = max(lens)
        row_tables = tables[:num_rows]
        # Prefill: the (B, L_max) rectangle, real tokens then padding in each row.
        ids = [t for p in prompts for t in p + [self.pad_token_id] * (width - len(p))]
        hidden = self._forward(ids, [0] * num_rows, width, row_tables, kv)  # (B * L_max, E)
        # Logits only where a token is sampled, as every serving path does (tidal included).
        last = torch.tensor([r * width + n - 1 for r, n in enumerate(lens)], device=self.device)
        first = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
        now = self.clock()
        outs = [[t] for t in first]
        done = [self._stops(outs[r], max_tokens[r], ignore_eos) for r in range(num_rows)]
        finished = [now if d else 0.0 for d in done]
        first_time, step = now, 0
        while not all(done):
            step += 1
            # Finished rows still take their slot and compute a padding token at the next position.
            ids = [self.pad_token_id if done[r] else outs[r][-1] for r in range(num_rows)]
            starts = [n + step - 1 for n in lens]
            hidden = self._forward(ids, starts, 1, row_tables, kv)  # (B, E)
            tokens = self.model.compute_logits(hidden).argmax(-1).tolist()
            now = self.clock()
            for r in range(num_rows):
                if done[r]:
                    continue
                outs[r].append(tokens[r])
                if self._stops(outs[r], max_tokens[r], ignore_eos):
                    done[r], finished[r] = True, now
        end = self.clock()
        return [
            StaticResult(prompts[r], outs[r], first_time, finished[r], end) for r in range(num_rows)
        ]

    def _forward(
        self,
        ids: list[int],
        starts: list[int],
        width: int,
        row_tables: list[list[list[int]]],
        kv: list,
    ) -> torch.Tensor:
        """`width` tokens per row at positions starts[r]..; final hidden states (B * width, E)."""
        num_rows = len(starts)
        meta = build_metadata(
            [width] * num_rows,
            [s + width for s in starts],
            row_tables,
            self.layout.block_size,
            self.device,
        )
        pos = torch.tensor(
            [s + j for s in starts for j in range(width)], dtype=torch.long, device=self.device
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model(input_ids, pos, meta, kv)

    def _stops(self, out: list[int], max_tokens: int, ignore_eos: bool) -> bool:
        return len(out) >= max_tokens or (not ignore_eos and out[-1] in self.eos_token_ids)
