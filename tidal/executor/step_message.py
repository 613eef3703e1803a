"""pack_step / unpack_step: one step's StepInputs as a single int64 tensor for a broadcast.

Layout (all int64):
    [T, S, G, n_sample, n_prompt]                      header: tokens, requests, KV groups, ...
    input_ids (T) | positions (T)
    num_tokens (S) | context_lens (S)
    table_lens (S * G, request-major) | tables (sum of table_lens)
    sample_rows (n_sample) | prompt spans (2 * n_prompt: start, count)
"""

from __future__ import annotations

import torch

from tidal.worker.model_runner import StepInputs

HEADER = 5


def pack_step(inputs: StepInputs) -> torch.Tensor:
    s = len(inputs.num_tokens)
    g = len(inputs.block_tables[0]) if s else 0
    table_lens = [len(t) for tables in inputs.block_tables for t in tables]
    flat_tables = [b for tables in inputs.block_tables for t in tables for b in t]
    head = [len(inputs.input_ids), s, g, len(inputs.sample_rows), len(inputs.prompt_spans)]
    rest = [
        *inputs.num_tokens,
        *inputs.context_lens,
        *table_lens,
        *flat_tables,
        *inputs.sample_rows,
        *(x for span in inputs.prompt_spans for x in span),
    ]
    return torch.cat(
        [
            torch.tensor(head, dtype=torch.long),
            inputs.input_ids.long(),
            inputs.positions.long(),
            torch.tensor(rest, dtype=torch.long),
        ]
    )


def unpack_step(msg: torch.Tensor) -> StepInputs:
    t, s, g, n_sample, n_prompt = msg[:HEADER].tolist()
    at = HEADER
    input_ids, positions = msg[at : at + t], msg[at + t : at + 2 * t]
    rest = msg[at + 2 * t :].tolist()
    num_tokens, context_lens = rest[:s], rest[s : 2 * s]
    table_lens = rest[2 * s : 2 * s + s * g]
    i = 2 * s + s * g
    block_tables: list[list[list[int]]] = []
    for r in range(s):
        tables = []
        for n in table_lens[r * g : (r + 1) * g]:
            tables.append(rest[i : i + n])
            i += n
        block_tables.append(tables)
    sample_rows = rest[i : i + n_sample]
    i += n_sample
    spans = rest[i : i + 2 * n_prompt]
    prompt_spans = [(spans[2 * j], spans[2 * j + 1]) for j in range(n_prompt)]
    return StepInputs(
        input_ids.clone(), positions.clone(), num_tokens, context_lens, block_tables,
        sample_rows, prompt_spans,
    )  # fmt: skip
