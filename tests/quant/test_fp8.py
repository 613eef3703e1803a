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


@pytest.mark.parametrize("rows", [1, 9, 40])
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


def test_kernel_decodes_every_finite_e4m3_value_exactly() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~torch.isnan(codes.float())]  # 254 values, subnormals and -0 included
    k = 256
    w = torch.zeros(1, k, dtype=torch.float8_e4m3fn)
    w[0, : finite.numel()] = finite
    q = Fp8Linear(w, torch.ones(1), None, torch.float32)
    eye = torch.eye(k)
    got = torch.cat([q(eye[i : i + 32]) for i in range(0, k, 32)]).flatten()
    assert torch.equal(got[: finite.numel()], finite.float())


def test_a_row_does_not_depend_on_its_batch() -> None:
    torch.manual_seed(2)
    lin = nn.Linear(96, 24, bias=True)
    q = Fp8Linear.from_linear(lin)
    x = torch.randn(9, 96)
    whole = q(x)
    for i in range(9):
        assert torch.equal(q(x[i : i + 1]), whole[i : i + 1])
