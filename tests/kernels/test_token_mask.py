"""The token-bitmask kernel against a torch reference: partial last word, rows not in the mask
list untouched, a mask that allows nothing leaves its row as it was."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels import token_mask

pytestmark = pytest.mark.skipif(not token_mask.available(), reason="no C compiler")


def _reference(logits: torch.Tensor, masks: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        allowed = [(int(masks[i, t // 32]) >> (t % 32)) & 1 if t // 32 < masks.shape[1] else 0
                   for t in range(vocab)]  # fmt: skip
        if any(allowed):
            out[r] = torch.where(torch.tensor(allowed, dtype=torch.bool), out[r], float("-inf"))
    return out


@pytest.mark.parametrize("vocab,words", [(70, 3), (64, 2), (100, 3)])  # 100 > 3 * 32
def test_kernel_matches_reference(vocab: int, words: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen)
    masks = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    masks[1] = 0  # allows nothing: row 3 stays as it is
    masks[2, 0] = -1  # a word allowing all 32
    rows = [0, 3, 2]
    expected = _reference(logits, masks, rows)
    got = logits.clone()
    assert token_mask.apply_token_bitmask_(got, masks, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])
