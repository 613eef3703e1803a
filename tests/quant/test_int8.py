"""Int8 weight-only: packing round trip, both matmul paths against the float reference, the lookup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.quant.int8 import KERNEL_MAX_ROWS, Int8Embedding, Int8Linear, quantize_rows


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    lin.weight.data.normal_(0, 0.05)
    return lin


def test_round_trip_within_half_a_step() -> None:
    w = _linear(48, 64).weight.detach()
    codes, scales = quantize_rows(w)
    assert codes.dtype == torch.int8 and scales.shape == (48,)
    assert codes.abs().max() == 127  # each row's largest value uses the full range
    err = (codes.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-6)).all()


def test_zero_row_stays_zero() -> None:
    w = torch.zeros(16, 32)
    w[3, 5] = 1.0
    codes, scales = quantize_rows(w)
    assert codes[0].abs().sum() == 0 and scales[0] == 1.0
    assert codes[3, 5] == 127


@pytest.mark.parametrize("rows", [1, 8, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 70])
def test_matmul_matches_dequantized_reference(rows: int) -> None:
    lin = _linear(48, 64, bias=True)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 64)
    ref = x @ q.dequantize().t() + lin.bias
    y = q(x)
    diff = (y - ref).abs().max().item()
    if rows <= KERNEL_MAX_ROWS:
        # The kernel rounds x and its output to bfloat16 (relative 2**-9 each): bound by that.
        bound = 2**-7 * (x.abs() @ q.dequantize().abs().t()).max().item()
    else:
        bound = 1e-5
    print(f"rows={rows} max |diff| {diff:.2e} (bound {bound:.2e})")
    assert diff <= bound
    # Against the float weights: the int8 step is the larger error, a few 1e-3 here.
    assert (y - lin(x)).abs().max().item() < 2e-2


def test_blocked_dequant_path_equals_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    q = Int8Linear.from_linear(_linear(40, 32))
    x = torch.randn(KERNEL_MAX_ROWS + 3, 32)
    whole = q(x)
    monkeypatch.setattr("tidal.quant.int8.BLOCK_VALUES", 32 * 7)  # 7 rows a block, last one short
    torch.testing.assert_close(q(x), whole, rtol=0, atol=1e-6)


def test_leading_dims_and_dtype_kept() -> None:
    q = Int8Linear.from_linear(_linear(16, 32))
    y = q(torch.randn(2, 3, 32))
    assert y.shape == (2, 3, 16) and y.dtype == torch.float32


def test_embedding_gathers_dequantized_rows() -> None:
    emb = nn.Embedding(50, 32)
    q = Int8Embedding.from_embedding(emb)
    ids = torch.tensor([[0, 7, 49], [7, 7, 1]])
    ref = q.codes.float() * q.scales[:, None]
    assert torch.equal(q(ids), ref[ids])
    assert (q(ids) - emb(ids)).abs().max() <= q.scales.max() / 2 * (1 + 1e-6)
