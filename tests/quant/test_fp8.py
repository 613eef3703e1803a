"""FP8 e4m3 storage: exact upcast, round trip, the matmul and the lookup against the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.quant.fp8 import E4M3_MAX, Fp8Embedding, Fp8Linear, quantize_rows, upcast


def test_round_trip_relative_error() -> None:
    w = torch.randn(24, 64) * 0.05
    codes, scales = quantize_rows(w)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.allclose(upcast(codes).abs().amax(1), torch.full((24,), E4M3_MAX))
    deq = upcast(codes) * scales[:, None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normals; subnormals step 2**-9.
    bound = torch.maximum(w.abs() * 2**-4, scales[:, None] * 2**-10)
    assert ((deq - w).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("rows", [1, 9])
def test_matmul_matches_reference(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    lin = nn.Linear(64, 40, bias=True)
    q = Fp8Linear.from_linear(lin)
    x = torch.randn(rows, 64)
    ref = x @ q.dequantize().t() + lin.bias
    torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr("tidal.quant.fp8.BLOCK_VALUES", 64 * 6)  # blocked path, short last block
    torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-5)


def test_embedding_rows() -> None:
    q = Fp8Linear.from_linear(nn.Linear(16, 30, bias=False))
    emb = Fp8Embedding(q.codes, q.scales, torch.float32)
    ids = torch.tensor([3, 0, 29, 3])
    assert torch.equal(emb(ids), q.dequantize()[ids])
