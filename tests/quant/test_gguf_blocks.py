"""GGUF blocks as the weight format: the same model as the float load, at the file's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.loader.test_weight_cache import Q, write_tiny_quantized_gemma
from tests.models.paged import paged_prefill_and_greedy
from tidal.config.quant import resolve_scheme
from tidal.kernels import gguf_gemm as gg
from tidal.kernels.gguf_gemm import BlockWeight, gguf_gemm
from tidal.layers.rotary import RotaryEmbedding
from tidal.loader.gguf_file import GGUFFile
from tidal.loader.model_loader import LoadedModel, load_model
from tidal.quant import gguf_blocks
from tidal.quant.gguf_blocks import GGUFEmbedding, GGUFLinear
from tidal.quant.registry import weight_bytes

# Prompts long enough for prefill tiles (> F32_KERNEL_MAX_ROWS rows in one step) and decode steps.
PROMPTS = [list(range(3, 43)), [9, 2, 40, 41, 60, 3, 8], [5, 17, 33]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf_blocks") / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    return path


# IQ4 storage for the matrices whose input size is a multiple of 256 (IQ4_XS's super-block).
IQ4_TYPES = {"attn_q": Q.IQ4_NL, "attn_output": Q.IQ4_XS, "ffn_gate": Q.IQ4_XS, "ffn_up": Q.IQ4_XS}


@pytest.fixture(scope="module")
def iq4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf_blocks") / "tiny-iq4.gguf"
    write_tiny_quantized_gemma(path, types=IQ4_TYPES)
    return path


def test_blocks_load_costs_the_files_bytes(tiny_gguf: Path) -> None:
    loaded = load_model(tiny_gguf, gguf_blocks=True)
    model = loaded.model
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert isinstance(model.lm_head, GGUFLinear)
    # The tied head reads the embedding's own blocks: one table.
    assert model.lm_head.parts[0].blocks is model.model.embed_tokens.weight_blocks.blocks
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear)  # Q5_0, Q8_0, Q8_0 in one call
    assert [p.ggml_type for p in layer.self_attn.qkv_proj.parts] == [6, 8, 8]
    assert isinstance(layer.mlp.gate_up_proj, GGUFLinear)
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in model.modules())
    with GGUFFile(tiny_gguf) as f:
        file_bytes = sum(info.nbytes for info in f.tensors.values())
    rotary = sum(m.inv_freq.nbytes for m in model.modules() if isinstance(m, RotaryEmbedding))
    # Blocks are counted at the file's size; the norms are float32 in both.
    assert weight_bytes(model) - rotary == file_bytes


def _assert_same_model(ref: LoadedModel, ours: LoadedModel, chunk: int | None) -> None:
    # Same greedy tokens, logits within 1e-4, through the paged cache (chunked prefill or not).
    ref_logits, ref_tokens = paged_prefill_and_greedy(ref.model, ref.arch, PROMPTS, 12, chunk)
    logits, tokens = paged_prefill_and_greedy(ours.model, ours.arch, PROMPTS, 12, chunk)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        worst = (a - b).abs().max().item()
        print(f"max |logit diff| {worst:.2e}")
        assert worst < 1e-4


@pytest.mark.parametrize("chunk", [None, 5])
def test_blocks_match_the_float_model(tiny_gguf: Path, chunk: int | None) -> None:
    ref = load_model(tiny_gguf, weight_cache=False)
    ours = load_model(tiny_gguf, gguf_blocks=True)
    _assert_same_model(ref, ours, chunk)


@pytest.mark.parametrize("chunk", [None, 5])
def test_iq4_blocks_match_the_float_model(iq4_gguf: Path, chunk: int | None) -> None:
    """IQ4_XS and IQ4_NL matrices stay blocks (the file's bytes) and give the float model."""
    ref = load_model(iq4_gguf, weight_cache=False)
    ours = load_model(iq4_gguf, gguf_blocks=True)
    layer = ours.model.model.layers[0]
    assert [p.ggml_type for p in layer.mlp.gate_up_proj.parts] == [int(Q.IQ4_XS)] * 2
    assert [p.ggml_type for p in layer.self_attn.o_proj.parts] == [int(Q.IQ4_XS)]
    assert layer.self_attn.qkv_proj.parts[0].ggml_type == int(Q.IQ4_NL)
    _assert_same_model(ref, ours, chunk)


def test_q8_activations_stay_close(tiny_gguf: Path) -> None:
    ref = load_model(tiny_gguf, gguf_blocks=True)
    ours = load_model(tiny_gguf, gguf_blocks=True)
    assert gguf_blocks.set_activations(ours.model, "q8") == 1 + 4 * ours.arch.num_layers
    ref_logits, _ = paged_prefill_and_greedy(ref.model, ref.arch, PROMPTS, 2)
    logits, _ = paged_prefill_and_greedy(ours.model, ours.arch, PROMPTS, 2)
    for a, b in zip(logits, ref_logits):
        # int8 activations per block of 32: ~0.4% of each block's largest |x| per value
        assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()


def _linear(tiny_gguf: Path, name: str) -> BlockWeight:
    with GGUFFile(tiny_gguf) as f:
        info = f.tensors[name]
        raw = torch.from_numpy(f.raw(name).copy())
        return BlockWeight.from_raw(raw, int(info.ggml_type), *info.shape)


@pytest.mark.parametrize("rows", [1, 3, 32, 33, 70])
def test_kernel_and_tiled_paths_agree(tiny_gguf: Path, rows: int) -> None:
    """The decode kernel and the prefill path (row tiles decoded for torch's matmul) compute the
    same product; with a bias, and for parts of different block types side by side."""
    parts = [_linear(tiny_gguf, "blk.0.attn_q.weight"), _linear(tiny_gguf, "blk.0.attn_k.weight")]
    bias = torch.randn(sum(p.rows for p in parts))
    layer = GGUFLinear(parts, bias, torch.float32)
    x = torch.randn(rows, parts[0].cols)
    w = layer.dequantize().double()
    expected = (x.double() @ w.t() + bias.double()).float()
    got = layer(x)
    tiled = layer._tiled_matmul(x) + bias
    kernel = gguf_gemm(x, parts) + bias
    for y in (got, tiled, kernel):
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("whole", [True, False], ids=["whole-matrix", "tiles"])
@pytest.mark.parametrize("gemm", gguf_blocks.CPU_GEMMS)
def test_prefill_gemms_agree_with_float64(
    tiny_gguf: Path, gemm: str, whole: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each float32 GEMM of the prefill rows (tidal's panels, oneDNN, MKL) gives the float64
    product of the dequantized weights to float32 rounding, also for a strided x (a view of a
    wider buffer); with oneDNN, a matrix decoded whole into one buffer and one decoded in row
    tiles alike."""
    if gemm == "onednn" and gguf_blocks._onednn_linear is None:
        pytest.skip("this torch build has no oneDNN linear")
    if gemm == "tidal" and "avx2" not in gg.isas():
        pytest.skip("the panel kernel is AVX2 only")
    monkeypatch.setenv("TIDAL_CPU_GEMM", gemm)
    if not whole:
        monkeypatch.setattr(gguf_blocks, "WHOLE_VALUES", 0)
        monkeypatch.setattr(gguf_blocks, "TILE_VALUES", 64 * 32)  # several tiles per part
    gguf_blocks.cpu_gemm.cache_clear()
    try:
        assert gguf_blocks.cpu_gemm() == gemm
        parts = [
            _linear(tiny_gguf, "blk.0.attn_q.weight"),
            _linear(tiny_gguf, "blk.0.attn_v.weight"),
        ]
        layer = GGUFLinear(parts, None, torch.float32)
        wide = torch.randn(70, parts[0].cols + 5)
        x = wide[:, 2 : 2 + parts[0].cols]
        expected = (x.double() @ layer.dequantize().double().t()).float()
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    finally:
        gguf_blocks.cpu_gemm.cache_clear()


def test_cpu_gemm_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CPU_GEMM", "blas")
    gguf_blocks.cpu_gemm.cache_clear()
    try:
        with pytest.raises(ValueError, match="TIDAL_CPU_GEMM"):
            gguf_blocks.cpu_gemm()
    finally:
        gguf_blocks.cpu_gemm.cache_clear()


@pytest.mark.skipif(not gg.available(), reason="no C compiler: the torch fallback runs")
def test_the_default_prefill_gemm_follows_the_block_kernels_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tidal's panels where the block kernels run AVX2 (also when TIDAL_KERNEL_ISA caps an
    AVX-512 machine there); a library where they run AVX-512 or the portable C; and
    TIDAL_CPU_GEMM=tidal refused where no AVX2 path exists."""
    library = "onednn" if gguf_blocks._onednn_linear is not None else "mkl"
    monkeypatch.delenv("TIDAL_CPU_GEMM", raising=False)
    try:
        for cap in ("avx512", "avx2", "scalar"):
            monkeypatch.setenv("TIDAL_KERNEL_ISA", cap)
            gg.default_isa.cache_clear()
            gguf_blocks.cpu_gemm.cache_clear()
            expected = "tidal" if gg.default_isa() == "avx2" else library
            assert gguf_blocks.cpu_gemm() == expected, cap
        if "avx2" not in gg.isas():  # (where it is, the cap "avx2" above chose the panels)
            monkeypatch.setenv("TIDAL_CPU_GEMM", "tidal")
            gguf_blocks.cpu_gemm.cache_clear()
            with pytest.raises(ValueError, match="AVX2"):
                gguf_blocks.cpu_gemm()
    finally:
        gg.default_isa.cache_clear()
        gguf_blocks.cpu_gemm.cache_clear()


def test_fuse_keeps_columns_in_order(tiny_gguf: Path) -> None:
    q = GGUFLinear([_linear(tiny_gguf, "blk.0.attn_q.weight")], None, torch.float32)
    k = GGUFLinear([_linear(tiny_gguf, "blk.0.attn_k.weight")], torch.ones(128), torch.float32)
    fused = GGUFLinear.fuse([q, k])
    assert fused is not None and fused.out_features == q.out_features + k.out_features
    x = torch.randn(4, q.in_features)
    torch.testing.assert_close(fused(x), torch.cat([q(x), k(x)], dim=-1))
    down = GGUFLinear([_linear(tiny_gguf, "blk.0.ffn_down.weight")], None, torch.float32)
    assert GGUFLinear.fuse([q, down]) is None  # different input sizes stay apart


def test_row_block_is_a_tile_of_16_only_for_int8_activations_on_amx(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = GGUFLinear([_linear(tiny_gguf, "blk.0.attn_q.weight")], None, torch.float32)
    model = nn.Sequential(layer)
    monkeypatch.setattr(gg, "available", lambda: True)
    for isa in ("amx", "avx512"):
        monkeypatch.setattr(gg, "default_isa", lambda isa=isa: isa)
        layer.act = "q8"
        assert gguf_blocks.row_block(model) == (16 if isa == "amx" else 1)
        layer.act = "f32"  # float activations never run on the tiles
        assert gguf_blocks.row_block(model) == 1
    assert gguf_blocks.row_block(nn.Linear(4, 4)) == 1


def test_bad_activation_mode_is_refused(tiny_gguf: Path) -> None:
    with pytest.raises(ValueError, match="act='int4' is invalid"):
        GGUFLinear([_linear(tiny_gguf, "blk.0.attn_q.weight")], None, torch.float32, act="int4")


def test_gguf_q8_needs_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tidal's C kernels auto falls back to float activations (torch runs them) and an
    explicit gguf-q8 is refused, not served in float."""
    from tidal.quant.gguf_blocks import native_scheme

    assert native_scheme("none", "auto") == "none"
    if gg.available():
        assert native_scheme("gguf-q8", "gguf-q8") == "gguf-q8"
    monkeypatch.setattr(gg, "available", lambda: False)
    assert native_scheme("gguf-q8", "auto") == "gguf"
    assert native_scheme("gguf", "gguf") == "gguf"
    with pytest.raises(ValueError, match="quantization='gguf-q8' is invalid here"):
        native_scheme("gguf-q8", "gguf-q8")


def test_quantize_check_of_gguf_q8_needs_the_kernels(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate refuses gguf-q8 where the engine would, before loading anything: without the
    kernels it would score float activations and store that verdict under gguf-q8's name."""
    from tidal.worker.gate import run_gate

    monkeypatch.setattr(gg, "available", lambda: False)
    with pytest.raises(ValueError, match="quantization='gguf-q8' is invalid here"):
        run_gate(tiny_gguf, "gguf-q8", max_tokens=16)


def test_auto_scheme_and_refusals(tiny_gguf: Path, tmp_path: Path) -> None:
    assert resolve_scheme("auto", True, "cpu") == "gguf-q8"
    assert resolve_scheme("auto", False, "cpu") == "none"
    assert resolve_scheme("auto", True, "cuda") == "none"
    assert resolve_scheme("int8", True, "cpu") == "int8"
    with pytest.raises(ValueError, match="quantization='gguf' is invalid for a checkpoint"):
        resolve_scheme("gguf", False, "cpu")
    with pytest.raises(ValueError, match="quantization='gguf-q8' is invalid for device cuda"):
        resolve_scheme("gguf-q8", True, "cuda")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="invalid for a HF directory"):
        load_model(tmp_path, gguf_blocks=True)
