"""Int4 groups of 32 (scale and min): quantization and packing round trips, the C kernel and the
fallback against the dequantized reference, batch invariance, the tied lookup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.quant.int4 import (
    GROUP_SIZE,
    Int4Embedding,
    Int4Linear,
    dequantize,
    pack_nibbles,
    quantize_groups,
    quantize_linear,
    quantize_tied_embedding,
    unpack_nibbles,
)
from tidal.quant.int8 import KERNEL_MAX_ROWS, Int8Linear


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    lin.weight.data.normal_(0, 0.05)
    return lin


def test_round_trip_within_half_a_step() -> None:
    w = _linear(32, 96).weight.detach()
    codes, scales, mins = quantize_groups(w)
    assert codes.min() == 0 and codes.max() == 15
    assert scales.shape == mins.shape == (32, 96 // GROUP_SIZE)
    err = (dequantize(pack_nibbles(codes), scales, mins) - w).abs().reshape(32, 3, GROUP_SIZE)
    assert (err <= scales[..., None] / 2 * (1 + 1e-5) + 1e-7).all()


def test_q4_k_style_groups_are_kept_exactly() -> None:
    """A group that is already code * scale + min with codes spanning 0..15 (GGUF's Q4_K form)
    comes back with the same codes."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    q[:, 0], q[:, 1], q[:, 32], q[:, 33] = 0, 15, 0, 15
    s = torch.rand(8, 2, generator=g) * 1e-2 + 1e-3
    m = -torch.rand(8, 2, generator=g) * 0.1
    w = dequantize(pack_nibbles(q), s, m)
    codes, _, _ = quantize_groups(w)
    assert torch.equal(codes, q)


def test_nibble_packing_round_trips() -> None:
    codes = (torch.arange(40 * 64).reshape(40, 64) % 16).to(torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (40, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    # byte j of a group: code j low, code j + 16 high
    assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4)


@pytest.mark.parametrize("rows", [1, 2, 4, 7, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1])
def test_matmul_matches_dequantized_reference(rows: int) -> None:
    lin = _linear(40, 64, bias=True)
    q = Int4Linear.from_linear(lin)
    x = torch.randn(rows, 64)
    deq = q.dequantize()
    bound = 1e-6 * (x.abs() @ deq.abs().t()).max().item() + 1e-6
    diff = (q(x) - (x @ deq.t() + lin.bias)).abs().max().item()
    assert diff <= bound, f"rows={rows}: max |diff| {diff:.2e} > {bound:.2e}"


def test_a_row_does_not_depend_on_its_batch() -> None:
    q = Int4Linear.from_linear(_linear(24, 128))
    x = torch.randn(11, 128)
    whole = q(x)
    for i in range(11):
        assert torch.equal(q(x[i : i + 1]), whole[i : i + 1])


def test_fallback_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    q = Int4Linear.from_linear(_linear(24, 64, bias=True))
    x = torch.randn(3, 64)
    fast = q(x)
    monkeypatch.setattr("tidal.quant.int4.int4_gemm", lambda *a: None)
    torch.testing.assert_close(q(x), fast, rtol=0, atol=1e-5)


def test_tied_embedding_reads_the_head_codes() -> None:
    emb = nn.Embedding(48, 64)
    head = nn.Linear(64, 48, bias=False)
    head.weight = emb.weight
    qh = Int4Linear.from_linear(head)
    qe = quantize_tied_embedding(qh, emb)
    assert isinstance(qe, Int4Embedding) and qe.packed.data_ptr() == qh.packed.data_ptr()
    ids = torch.tensor([[0, 5, 47]])
    assert torch.equal(qe(ids), qh.dequantize()[ids])


def test_inputs_not_divisible_by_group_fall_back_to_int8() -> None:
    assert isinstance(quantize_linear(nn.Linear(40, 16)), Int8Linear)
