"""Workload: a seeded set of offline requests with mixed prompt lengths and mixed output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One offline request: its prompt token ids and how many tokens it must generate."""

    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(
    num_prompts: int,
    seed: int,
    vocab_size: int,
    *,
    min_prompt_len: int = 16,
    max_prompt_len: int = 512,
    min_tokens: int = 16,
    max_tokens: int = 256,
    first_token_id: int = 3,
    bos_token_id: int | None = None,
) -> list[WorkItem]:
    """Random token prompts (vLLM's "random" dataset idea): lengths log-uniform in
    [min_prompt_len, max_prompt_len] so short and long prompts both occur, and output lengths
    uniform in [min_tokens, max_tokens], because uneven outputs are what static batching pays for.

    Token ids are drawn from [first_token_id, vocab_size) so the low special ids stay out; a
    `bos_token_id` is prepended (and counted in the length) when given. The same arguments always
    give the same list."""
    _check(num_prompts >= 1, "num_prompts", num_prompts, "an integer >= 1")
    _check(
        1 <= min_prompt_len <= max_prompt_len,
        "min_prompt_len/max_prompt_len",
        (min_prompt_len, max_prompt_len),
        "1 <= min_prompt_len <= max_prompt_len",
    )
    _check(
        1 <= min_tokens <= max_tokens,
        "min_tokens/max_tokens",
        (min_tokens, max_tokens),
        "1 <= min_tokens <= max_tokens",
    )
    _check(
        0 <= first_token_id < vocab_size,
        "first_token_id",
        first_token_id,
        f"an id in [0, vocab_size={vocab_size})",
    )
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        # Log-uniform: as many prompts in 16..64 as in 128..512.
        length = round(min_prompt_len * (max_prompt_len / min_prompt_len) ** rng.random())
        length = min(max(length, min_prompt_len), max_prompt_len)
        body_len = length - (1 if bos_token_id is not None else 0)
        body = [rng.randrange(first_token_id, vocab_size) for _ in range(body_len)]
        prompt = ([bos_token_id] if bos_token_id is not None else []) + body
        items.append(WorkItem(prompt, rng.randint(min_tokens, max_tokens)))
    return items


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {accepted}")
