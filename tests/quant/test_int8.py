"""Int8 weight-only in groups: quantization round trip, the C kernel and the fallback against the
dequantized reference, batch invariance, the lookup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.kernels.int8_gemm import available
from tidal.quant.int8 import (
    GROUP_SIZE,
    KERNEL_MAX_ROWS,
    Int8Embedding,
    Int8Linear,
    dequantize_groups,
    quantize_groups,
    quantize_rows,
)


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    lin.weight.data.normal_(0, 0.05)
    return lin


def test_round_trip_within_half_a_step() -> None:
    w = _linear(48, 64).weight.detach()
    codes, scales = quantize_groups(w, GROUP_SIZE)
    assert codes.dtype == torch.int8 and scales.shape == (48, 2)
    # each group's largest |w| uses the full range
    assert (codes.reshape(48, 2, GROUP_SIZE).abs().amax(-1) == 127).all()
    err = (dequantize_groups(codes, scales) - w).abs().reshape(48, 2, GROUP_SIZE)
    assert (err <= scales[..., None] / 2 * (1 + 1e-6)).all()


def test_q8_0_blocks_requantize_to_the_same_codes() -> None:
    """GGUF's Q8_0 stores absmax/127 blocks of 32: dequantized, they come back unchanged."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
    q[:, 0], q[:, 32] = 127, -127  # llama.cpp's rounding puts each block's max at +-127
    d = (torch.rand(16, 2, generator=g) * 1e-3 + 1e-4).half().float()
    w = dequantize_groups(q, d)
    codes, scales = quantize_groups(w, GROUP_SIZE)
    assert torch.equal(codes, q)
    torch.testing.assert_close(scales, d, rtol=1e-6, atol=0)


def test_zero_group_stays_zero() -> None:
    w = torch.zeros(16, 32)
    w[3, 5] = 1.0
    codes, scales = quantize_rows(w)
    assert codes[0].abs().sum() == 0 and scales[0] == 1.0
    assert codes[3, 5] == 127


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 70])
def test_matmul_matches_dequantized_reference(rows: int) -> None:
    lin = _linear(48, 64, bias=True)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 64)
    ref = x @ q.dequantize().t() + lin.bias
    # float32 accumulation in another order than the reference: a few ulps of sum |x||w|
    bound = 1e-6 * (x.abs() @ q.dequantize().abs().t()).max().item() + 1e-6
    diff = (q(x) - ref).abs().max().item()
    assert diff <= bound, f"rows={rows}: max |diff| {diff:.2e} > {bound:.2e}"
    # Against the float weights: the int8 step is the larger error, about 1e-3 here.
    assert (q(x) - lin(x)).abs().max().item() < 1e-2


def test_kernel_is_built_on_this_machine() -> None:
    """CI machines have a C compiler: the kernel path is the one the tests exercise."""
    assert available()


def test_a_row_does_not_depend_on_its_batch() -> None:
    q = Int8Linear.from_linear(_linear(40, 96, bias=True))
    x = torch.randn(KERNEL_MAX_ROWS, 96)
    whole = q(x)
    for i in (0, 5, KERNEL_MAX_ROWS - 1):
        assert torch.equal(q(x[i : i + 1]), whole[i : i + 1])
    assert torch.equal(q(x[3:10]), whole[3:10])


def test_per_channel_when_groups_do_not_divide() -> None:
    lin = _linear(16, 40)  # 40 % 32 != 0: one scale per row
    q = Int8Linear.from_linear(lin)
    assert q.group_size == 40 and q.scales.shape == (16, 1)
    x = torch.randn(3, 40)
    torch.testing.assert_close(q(x), x @ q.dequantize().t(), rtol=0, atol=1e-5)


def test_blocked_dequant_path_equals_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    q = Int8Linear.from_linear(_linear(40, 32))
    x = torch.randn(KERNEL_MAX_ROWS + 3, 32)
    whole = q(x)
    monkeypatch.setattr("tidal.quant.int8.BLOCK_VALUES", 32 * 7)  # 7 rows a block, last one short
    torch.testing.assert_close(q(x), whole, rtol=0, atol=1e-6)


def test_fallback_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    q = Int8Linear.from_linear(_linear(24, 64, bias=True))
    x = torch.randn(2, 64)
    fast = q(x)
    monkeypatch.setattr("tidal.quant.int8.int8_gemm", lambda *a: None)
    torch.testing.assert_close(q(x), fast, rtol=0, atol=1e-5)


def test_leading_dims_and_dtype_kept() -> None:
    q = Int8Linear.from_linear(_linear(16, 32))
    y = q(torch.randn(2, 3, 32))
    assert y.shape == (2, 3, 16) and y.dtype == torch.float32
    qb = Int8Linear.from_linear(_linear(16, 32).to(torch.bfloat16))
    assert qb(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_embedding_gathers_dequantized_rows() -> None:
    emb = nn.Embedding(50, 64)
    q = Int8Embedding.from_embedding(emb)
    ids = torch.tensor([[0, 7, 49], [7, 7, 1]])
    ref = dequantize_groups(q.codes, q.scales)
    assert torch.equal(q(ids), ref[ids])
    assert (q(ids) - emb(ids)).abs().max() <= q.scales.max() / 2 * (1 + 1e-6)
