"""Int4 group-wise: packing round trip, the CPU kernel and the portable path against the reference."""

from __future__ import annotations

import torch
from torch import nn

from tidal.quant.int4 import (
    GROUP_SIZE,
    Int4Linear,
    dequantize_groups,
    quantize_groups,
    quantize_linear,
)
from tidal.quant.int8 import Int8Linear


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def test_round_trip_within_half_a_step() -> None:
    w = _weight(32, 96)
    codes, scales, zeros = quantize_groups(w)
    assert codes.min() >= 0 and codes.max() <= 15
    assert scales.shape == zeros.shape == (32, 96 // GROUP_SIZE)
    err = (dequantize_groups(codes, scales, zeros) - w).abs().reshape(32, 3, GROUP_SIZE)
    # Half a step, plus the bfloat16 rounding of zero (the codes were chosen for the rounded one).
    step = scales.float()[..., None]
    assert (err <= step / 2 + 2**-8 * zeros.float().abs()[..., None] + 1e-7).all()


def _check_module(q: Int4Linear, w: torch.Tensor, rows: int) -> None:
    codes, scales, zeros = quantize_groups(w)
    deq = dequantize_groups(codes, scales, zeros)
    # On the kernel path dequantize() is the kernel's bfloat16 output.
    rtol = 2**-8 if q.use_kernel else 0.0
    torch.testing.assert_close(q.dequantize(), deq, rtol=rtol, atol=1e-6)
    x = torch.randn(rows, w.shape[1])
    ref = x @ deq.t()
    # bfloat16 activations and outputs: relative 2**-9 each, bounded by 2**-7 of sum |x||w|.
    bound = 2**-7 * (x.abs() @ deq.abs().t()).max().item() if q.use_kernel else 1e-5
    diff = (q(x) - ref).abs().max().item()
    print(f"kernel={q.use_kernel} rows={rows} max |diff| {diff:.2e} (bound {bound:.2e})")
    assert diff <= bound


def test_cpu_kernel_matches_reference() -> None:
    w = _weight(48, 64)
    lin = nn.Linear(64, 48, bias=False)
    lin.weight.data.copy_(w)
    q = Int4Linear.from_linear(lin)
    assert q.use_kernel
    for rows in (1, 8, 33):
        _check_module(q, w, rows)


def test_portable_path_matches_reference() -> None:
    w = _weight(40, 64)  # 40 rows: not a multiple of 16, so no CPU kernel
    lin = nn.Linear(64, 40, bias=True)
    lin.weight.data.copy_(w)
    q = Int4Linear.from_linear(lin)
    assert not q.use_kernel and q.packed.shape == (40, 32) and q.packed.dtype == torch.uint8
    x = torch.randn(5, 64)
    ref = x @ q.dequantize().t() + lin.bias
    torch.testing.assert_close(q(x), ref, rtol=0, atol=1e-5)
    lin.bias = None
    _check_module(Int4Linear.from_linear(lin), w, 3)


def test_nibble_packing_round_trips() -> None:
    codes = torch.arange(40 * 64).reshape(40, 64) % 16
    scales = torch.ones(40, 2, dtype=torch.bfloat16)
    q = Int4Linear(codes.to(torch.int32), scales, torch.zeros_like(scales), None, torch.float32)
    assert torch.equal(q.dequantize(), codes.float() - 8.0)


def test_inputs_not_divisible_by_group_fall_back_to_int8() -> None:
    assert isinstance(quantize_linear(nn.Linear(40, 16)), Int8Linear)
