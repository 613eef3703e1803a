"""The norm/rotary C kernel against torch's RMSNorm and rotate-half rotary, on strided rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels import norm_rope
from tidal.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(not norm_rope.available(), reason="no C compiler")


def _reference_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * scale.double()).float()


@pytest.mark.parametrize("n", [640, 256, 13])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_rms_norm_matches_torch(n: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, n, generator=g) * 3
    scale = 1.0 + torch.randn(n, generator=g) * 0.1
    got = norm_rope.rms_norm(x, scale, 1e-6)
    torch.testing.assert_close(got, _reference_norm(x, scale, 1e-6), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (n,), scale, 1e-6), rtol=2e-6, atol=2e-6)
    # A row's result is the same bits whatever else is in the call.
    for r in range(rows):
        assert torch.equal(norm_rope.rms_norm(x[r : r + 1], scale, 1e-6), got[r : r + 1])


def test_rms_norm_reads_strided_rows_and_refuses_what_it_cannot_take() -> None:
    wide = torch.randn(5, 3, 64)  # heads of a (T, H, D) view with a row stride, like qkv columns
    x = wide[:, 1:]
    scale = torch.rand(64)
    torch.testing.assert_close(
        norm_rope.rms_norm(x, scale, 1e-5), _reference_norm(x, scale, 1e-5), rtol=2e-6, atol=2e-6
    )
    assert norm_rope.rms_norm(x.double(), scale, 1e-5) is None
    assert norm_rope.rms_norm(x.transpose(1, 2), scale, 1e-5) is None  # inner stride != 1


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_matches_torch_in_place(with_norm: bool) -> None:
    t, h, kvh, d = 6, 4, 1, 256
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.view(t, h, d), k.view(t, kvh, d)
    pos = torch.arange(t, dtype=torch.float32) * 37
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sq = 1.0 + torch.randn(d, generator=g) * 0.1 if with_norm else None
    sk = 1.0 + torch.randn(d, generator=g) * 0.1 if with_norm else None
    ref_q, ref_k = q.clone(), k.clone()
    if with_norm:
        ref_q, ref_k = _reference_norm(ref_q, sq, 1e-6), _reference_norm(ref_k, sk, 1e-6)
    ref_q, ref_k = apply_rotary(ref_q, cos, sin), apply_rotary(ref_k, cos, sin)
    v_before = v.clone()
    assert norm_rope.qk_norm_rope_(q, k, sq, sk, 1e-6, cos, sin)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before)  # the value columns beside them are untouched
