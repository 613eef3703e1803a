"""The argmax kernel against torch.argmax(dim=-1) on every path this machine runs: ties, NaN,
infinities, signed zeros, rows shorter than a vector and odd tails, strided rows."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels import argmax

pytestmark = pytest.mark.skipif(not argmax.available(), reason="no C compiler")
ISAS = argmax.isas()


def _rows(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(12, vocab, generator=gen)
    top = x.max().item() + 1.0
    x[1, vocab // 2] = float("nan")
    x[1, vocab - 1] = float("nan")  # the first NaN wins
    x[2].fill_(float("-inf"))  # every entry ties: index 0
    x[3, vocab - 1] = top  # the maximum in the tail (or the last lane)
    x[4, 0] = top  # at index 0
    x[5, vocab // 3] = x[5, vocab - 1] = top  # a tie: the first
    x[6, vocab - 1] = float("inf")
    x[7].fill_(0.0)
    x[7, vocab // 2] = -0.0  # -0.0 == 0.0: still index 0
    x[8].fill_(-1.0)
    x[8, vocab // 2 :] = 0.0
    x[8, vocab - 1] = -0.0
    x[9, vocab - 1] = float("nan")  # a NaN only in the tail
    x[10, 0] = float("nan")
    x[11] = x[11].round()  # many ties
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 33, 100, 1000, 4099, 262144])
def test_matches_torch(isa: str, vocab: int) -> None:
    x = _rows(vocab, vocab)
    got = argmax.argmax_rows(x, isa)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("isa", ISAS)
def test_rows_of_a_wider_buffer_and_alone(isa: str) -> None:
    wide = _rows(1100, 3)
    x = wide[:, 5:1005]  # row stride 1100, the padded-vocabulary case
    got = argmax.argmax_rows(x, isa)
    assert got is not None and torch.equal(got, x.argmax(dim=-1))
    for b in range(x.shape[0]):  # a row's result never depends on its batch
        alone = argmax.argmax_rows(x[b : b + 1], isa)
        assert alone is not None and int(alone[0]) == int(got[b])


def test_refuses_what_it_cannot_take() -> None:
    assert argmax.argmax_rows(torch.randn(2, 8).double()) is None
    assert argmax.argmax_rows(torch.randn(8, 2).t()) is None  # inner stride 2
    assert argmax.argmax_rows(torch.randn(8)) is None
    assert argmax.argmax_rows(torch.randn(0, 8)).shape == (0,)
    with pytest.raises(ValueError, match="cannot run here"):
        argmax.argmax_rows(torch.randn(2, 8), isa="neon")


def test_paths_and_the_env_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.kernels.isa import default_path, runnable_paths

    flags = frozenset({"avx2", "fma", "f16c"})
    assert runnable_paths({"avx512": True, "avx2": True}, flags) == ["avx2", "scalar"]
    assert runnable_paths({"avx2": False}, flags) == ["scalar"]
    monkeypatch.delenv("TIDAL_KERNEL_ISA", raising=False)
    assert default_path(["avx2", "scalar"]) == "avx2"
    monkeypatch.setenv("TIDAL_KERNEL_ISA", "scalar")
    assert default_path(["avx2", "scalar"]) == "scalar"
    monkeypatch.setenv("TIDAL_KERNEL_ISA", "avx512")
    assert default_path(["avx2", "scalar"]) == "avx2"
    assert argmax.isas()[-1] == "scalar"
    # gguf_gemm's own avx2vnni sits between avx2 and avx512; every other kernel reads it as avx2
    from tidal.kernels.isa import ISA_AVX2, capped_isa, requested_isa

    both = ["avx512", "avx2vnni", "avx2", "scalar"]
    monkeypatch.setenv("TIDAL_KERNEL_ISA", "avx2vnni")
    assert default_path(both) == "avx2vnni" and default_path(["avx2", "scalar"]) == "avx2"
    assert requested_isa() == ISA_AVX2 and capped_isa(2) == ISA_AVX2
    monkeypatch.setenv("TIDAL_KERNEL_ISA", "avx2")
    assert default_path(both) == "avx2"
    # its amx sits above avx512, which every other kernel runs under that name
    from tidal.kernels.isa import ISA_AVX512

    every = ["amx", *both]
    monkeypatch.setenv("TIDAL_KERNEL_ISA", "amx")
    assert default_path(every) == "amx" and default_path(both) == "avx512"
    assert requested_isa() == ISA_AVX512 and capped_isa(ISA_AVX512) == ISA_AVX512
    monkeypatch.setenv("TIDAL_KERNEL_ISA", "avx512")
    assert default_path(every) == "avx512"
    monkeypatch.setenv("TIDAL_KERNEL_ISA", "neon")
    with pytest.raises(ValueError, match="avx2vnni"):
        default_path(both)
