"""AttentionMetadata: where this step's tokens sit in their sequences and in the paged KV pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GroupTables:
    """One KV group's view of the step."""

    # (num_seqs, max_blocks) int64 block ids; padded with the null block 0.
    block_tables: torch.Tensor
    # (num_tokens,) int64 flat slot (block_id * block_size + offset) where each new token's K/V goes.
    slot_mapping: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Sequences are packed back to back with no padding:

    tokens:  [ seq0 q0 .. q(n0-1) | seq1 q0 .. q(n1-1) | ... ]
    seq i's queries sit at positions context_lens[i] - query_lens[i] ... context_lens[i] - 1
    """

    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # tokens with K/V after this step (cached + new) per sequence
    query_start: list[int]  # offset of each sequence's first token in the packed batch
    groups: list[GroupTables]  # per KV group (see tidal.kv.layout.KVLayout)
    block_size: int
    all_decode: bool  # every sequence has exactly one new token
    # (3, num_seqs) int32 on the step's device, rows query_start, query_lens, context_lens: the
    # lists above as the native kernel reads them, built once per step rather than per layer.
    seq_arrays: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def build_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[Sequence[int]]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """block_tables[i][g] is sequence i's table in group g, covering at least its context."""
    num_groups = len(block_tables[0]) if block_tables else 0
    query_start, offset = [], 0
    for n in query_lens:
        query_start.append(offset)
        offset += n
    groups = []
    for g in range(num_groups):
        tables = [list(bt[g]) for bt in block_tables]
        width = max(1, max(len(t) for t in tables))
        padded = torch.zeros((len(tables), width), dtype=torch.int64)
        slots: list[int] = []
        for i, table in enumerate(tables):
            padded[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
            start = context_lens[i] - query_lens[i]
            for pos in range(start, context_lens[i]):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        groups.append(
            GroupTables(padded.to(device), torch.tensor(slots, dtype=torch.int64, device=device))
        )
    return AttentionMetadata(
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        query_start=query_start,
        groups=groups,
        block_size=block_size,
        all_decode=all(n == 1 for n in query_lens),
        seq_arrays=torch.tensor(
            [query_start, list(query_lens), list(context_lens)], dtype=torch.int32, device=device
        ),
    )
