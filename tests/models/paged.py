"""A minimal paged runner for model tests: contiguous blocks per sequence, greedy decoding."""

from __future__ import annotations

import torch

from tidal.attention.metadata import build_metadata
from tidal.config.arch import ArchConfig
from tidal.kv.layout import KVLayout
from tidal.worker.kv_cache import allocate_kv_caches


class PagedBatch:
    """Runs several sequences together through the model's paged attention."""

    def __init__(
        self,
        model: torch.nn.Module,
        arch: ArchConfig,
        max_len: int,
        num_seqs: int,
        block_size: int = 4,
    ) -> None:
        self.model, self.arch, self.block_size = model, arch, block_size
        dtype = next(model.parameters()).dtype
        self.layout = KVLayout.from_layer_windows(
            arch.layer_windows(),
            block_size=block_size,
            num_kv_heads=arch.kv_cache_heads,
            head_dim=arch.kv_cache_head_dim,
            parts=arch.kv_cache_parts,
            dtype_bytes=dtype.itemsize,
        )
        blocks_per_seq = -(-max_len // block_size)
        num_groups = len(self.layout.groups)
        # Block 0 is the null block; every (sequence, group) gets its own contiguous run of ids.
        num_blocks = 1 + num_seqs * num_groups * blocks_per_seq
        self.tables = [
            [
                [1 + (i * num_groups + g) * blocks_per_seq + b for b in range(blocks_per_seq)]
                for g in range(num_groups)
            ]
            for i in range(num_seqs)
        ]
        self.kv = allocate_kv_caches(self.layout, num_blocks, dtype, "cpu")

    @torch.no_grad()
    def step(self, chunks: list[list[int]], starts: list[int], seq_ids: list[int]) -> torch.Tensor:
        """Compute chunks[i] at positions starts[i].. for sequences seq_ids[i]; logits (T, vocab)."""
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        pos = torch.tensor(
            [s + j for c, s in zip(chunks, starts) for j in range(len(c))], dtype=torch.long
        )
        meta = build_metadata(
            [len(c) for c in chunks],
            [s + len(c) for c, s in zip(chunks, starts)],
            [self.tables[i] for i in seq_ids],
            self.block_size,
            torch.device("cpu"),
        )
        hidden = self.model(ids, pos, meta, self.kv)
        return self.model.compute_logits(hidden)


def paged_prefill_and_greedy(
    model: torch.nn.Module,
    arch: ArchConfig,
    prompts: list[list[int]],
    max_new: int,
    chunk: int | None = None,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """All prompts prefilled together (optionally in chunks), then decoded together greedily.
    Returns per-prompt logits over the prompt positions and the generated ids."""
    batch = PagedBatch(model, arch, max(len(p) for p in prompts) + max_new, len(prompts))
    prompt_logits = paged_prefill(batch, prompts, chunk)
    outs = [[int(pl[-1].argmax())] for pl in prompt_logits]
    for _ in range(max_new - 1):
        lens = [len(p) + len(o) - 1 for p, o in zip(prompts, outs)]
        logits = batch.step([[o[-1]] for o in outs], lens, list(range(len(prompts))))
        for i, row in enumerate(logits):
            outs[i].append(int(row.argmax()))
    return prompt_logits, outs


def paged_prefill(
    batch: PagedBatch, prompts: list[list[int]], chunk: int | None = None
) -> list[torch.Tensor]:
    """Prefill every prompt (sequence i of `batch`) together, in chunks of `chunk` tokens when
    given; per prompt, the logits over its positions (T_i, V)."""
    prompt_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        chunks = [prompts[i][done[i] : done[i] + (chunk or len(prompts[i]))] for i in live]
        logits = batch.step(chunks, [done[i] for i in live], live)
        offset = 0
        for i, c in zip(live, chunks):
            prompt_logits[i].append(logits[offset : offset + len(c)])
            offset += len(c)
            done[i] += len(c)
    return [torch.cat(pl) for pl in prompt_logits]
