"""Torch dequantizers against gguf.quants (the numpy reference) on made and random blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.loader.test_gguf_file import bundled_gguf_path
from tidal.loader.gguf_file import GGUFFile
from tidal.quant import gguf_dequant
from tidal.quant.gguf_dequant import dequantize, q8_0_codes, type_size
from tidal.quant.gguf_types import GGMLType

# Byte offsets of the fp16 scale fields in each block: random bytes there may be inf/nan,
# so the tests overwrite them with finite halves.
FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
    GGMLType.TQ1_0: (52,),
    GGMLType.TQ2_0: (64,),
    GGMLType.MXFP4: (),  # its one-byte E8M0 exponent is finite for every byte
}
QUANTIZABLE = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0)


def _check(ours: torch.Tensor, ref: np.ndarray, label: str) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape, (label, tuple(ours.shape), ref.shape)
    ref32 = ref.astype(np.float32)
    max_diff = float(np.max(np.abs(ours.numpy() - ref32))) if ref.size else 0.0
    print(f"{label}: max |ours - gguf| = {max_diff}")
    np.testing.assert_array_equal(ours.numpy(), ref32)


def _random_blocks(ggml_type: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, cols // block_elems * block_bytes) uint8 of random blocks with finite scales."""
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = type_size(ggml_type)
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[ggml_type]:
        halves = rng.standard_normal(blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf(ggml_type: GGMLType) -> None:
    data = np.random.default_rng(1).standard_normal((6, 128)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType(int(ggml_type))
    packed = gguf.quants.quantize(data, qtype)
    ours = dequantize(torch.from_numpy(packed).reshape(-1), ggml_type, (6, 128))
    _check(ours, gguf.quants.dequantize(packed, qtype), ggml_type.name)


@pytest.mark.parametrize("ggml_type", list(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks(ggml_type: GGMLType) -> None:
    block_elems, _ = type_size(ggml_type)
    rows, cols = 5, block_elems * 3
    packed = _random_blocks(ggml_type, rows, cols, seed=int(ggml_type))
    ref = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType(int(ggml_type)))
    ours = dequantize(torch.from_numpy(packed).reshape(-1), ggml_type, (rows, cols))
    _check(ours, ref, ggml_type.name)


@pytest.mark.parametrize(
    "ggml_type", [GGMLType.F32, GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name
)
def test_float_types(ggml_type: GGMLType) -> None:
    data = np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType(int(ggml_type))
    packed = gguf.quants.quantize(data, qtype)
    raw = torch.from_numpy(np.ascontiguousarray(packed).view(np.uint8).reshape(-1))
    _check(
        dequantize(raw, ggml_type, (3, 4, 5)), gguf.quants.dequantize(packed, qtype), ggml_type.name
    )


def test_q8_k() -> None:
    # gguf has no Q8_K reference; its definition is value = d (fp32) * q (int8).
    rng = np.random.default_rng(3)
    _, block_bytes = type_size(GGMLType.Q8_K)
    blocks = rng.integers(0, 256, size=(4, block_bytes), dtype=np.uint8)
    d = rng.standard_normal(4).astype(np.float32)
    blocks[:, 0:4] = d.view(np.uint8).reshape(4, 4)
    ref = d[:, None] * blocks[:, 4:260].view(np.int8).astype(np.float32)
    ours = dequantize(torch.from_numpy(blocks).reshape(-1), GGMLType.Q8_K, (2, 512))
    _check(ours, ref.reshape(2, 512), "Q8_K")


def test_slicing_into_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tiny chunk size forces many slices, including a short last one.
    monkeypatch.setattr(gguf_dequant, "CHUNK_ELEMS", 512)
    packed = _random_blocks(GGMLType.Q4_K, 7, 768, seed=4)
    ref = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_K)
    _check(
        dequantize(torch.from_numpy(packed).reshape(-1), GGMLType.Q4_K, (7, 768)),
        ref,
        "Q4_K chunked",
    )


def test_q8_0_codes() -> None:
    data = np.random.default_rng(5).standard_normal((3, 96)).astype(np.float32)
    packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)  # (3, 3 * 34)
    raw = torch.from_numpy(packed).reshape(-1)
    codes, scales = q8_0_codes(raw, (3, 96))
    assert codes.dtype == torch.int8 and codes.shape == (3, 96)
    assert scales.dtype == torch.float32 and scales.shape == (3, 3)
    blocks = packed.reshape(-1, 34)
    assert np.array_equal(codes.numpy().reshape(-1, 32), blocks[:, 2:].view(np.int8))
    assert np.array_equal(
        scales.numpy().reshape(-1),
        blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1),
    )
    rebuilt = codes.float() * scales.repeat_interleave(32, dim=1)
    assert torch.equal(rebuilt, dequantize(raw, GGMLType.Q8_0, (3, 96)))


def test_errors() -> None:
    with pytest.raises(ValueError, match="IQ2_XXS cannot be dequantized"):
        dequantize(torch.zeros(66, dtype=torch.uint8), GGMLType.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="raw must be uint8 with 34 bytes"):
        dequantize(torch.zeros(33, dtype=torch.uint8), GGMLType.Q8_0, (32,))
    with pytest.raises(ValueError, match="not a multiple of 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), GGMLType.Q4_K, (128,))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_codes(torch.zeros(34, dtype=torch.uint8), (16,))
    assert type_size(GGMLType.Q6_K) == (256, 210)


def test_bundled_one_tensor_per_type() -> None:
    with GGUFFile(bundled_gguf_path()) as f:
        first_of_type: dict[GGMLType, str] = {}
        for name, info in f.tensors.items():
            first_of_type.setdefault(info.ggml_type, name)
        assert set(first_of_type) == {
            GGMLType.F32,
            GGMLType.Q8_0,
            GGMLType.Q5_0,
            GGMLType.Q4_K,
            GGMLType.Q6_K,
        }
        for ggml_type, name in first_of_type.items():
            info = f.tensors[name]
            raw = f.raw(name)
            rows = info.shape[0] if len(info.shape) > 1 else 1
            # Compare at most 512 rows: numpy on the whole 262144-row embedding takes seconds.
            num_rows = min(rows, 512)
            row_bytes = info.nbytes // rows
            part = raw[: num_rows * row_bytes].reshape(num_rows, row_bytes)
            shape = (num_rows, *info.shape[1:]) if len(info.shape) > 1 else info.shape
            ref = gguf.quants.dequantize(
                np.asarray(part), gguf.GGMLQuantizationType(int(ggml_type))
            )
            ours = dequantize(torch.from_numpy(part).reshape(-1), ggml_type, shape)
            _check(ours, ref.reshape(shape), f"bundled {name} ({ggml_type.name})")
            full = f.load_tensor(name) if num_rows == rows else None
            if full is not None:
                assert torch.equal(full, ours)


def test_block_mode_keeps_what_the_kernels_read_and_decodes_the_rest(tmp_path) -> None:
    """A GGUF's IQ4 matrices load in the native-block mode too: the kernels read Q8_0, IQ4_NL and
    IQ4_XS (block weights, decoding to exactly gguf's values); a type they do not read (Q4_1)
    comes out dequantized to float32."""
    from types import SimpleNamespace

    from tidal.kernels.gguf_gemm import SUPPORTED_TYPES, BlockWeight
    from tidal.loader.weights import iter_gguf_weights
    from tidal.quant.gguf_blocks import decode_rows

    tensors = {
        "blk.0.ffn_up.weight": (GGMLType.IQ4_NL, 4, 64),
        "blk.0.ffn_down.weight": (GGMLType.IQ4_XS, 2, 256),
        "blk.0.ffn_gate.weight": (GGMLType.Q8_0, 4, 64),
        "blk.0.attn_q.weight": (GGMLType.Q4_1, 4, 64),
    }
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2")
    packed = {}
    for name, (ggml_type, rows, cols) in tensors.items():
        blocks = _random_blocks(ggml_type, rows, cols, seed=rows + cols)
        qtype = gguf.GGMLQuantizationType(int(ggml_type))
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        packed[name] = gguf.quants.dequantize(blocks, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = SimpleNamespace(family="qwen2")
    loaded = dict(iter_gguf_weights(tmp_path / "m.gguf", arch, "qwen2", keep_blocks=lambda _: True))
    assert int(GGMLType.Q4_1) not in SUPPORTED_TYPES  # else this test checks nothing
    assert isinstance(loaded["model.layers.0.mlp.gate_proj.weight"], BlockWeight)
    for hf, name, ggml_type in (
        ("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight", GGMLType.IQ4_NL),
        ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", GGMLType.IQ4_XS),
    ):
        w = loaded[hf]
        assert isinstance(w, BlockWeight) and w.ggml_type == int(ggml_type)
        _check(decode_rows(w, 0, w.rows), packed[name], ggml_type.name)
    _check(loaded["model.layers.0.self_attn.q_proj.weight"], packed["blk.0.attn_q.weight"], "Q4_1")
