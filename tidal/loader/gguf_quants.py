"""Vectorized torch dequantizers for ggml tensor storage types (one function per block layout)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.loader.gguf_file import BLOCK_SIZES, GGMLType


def type_size(ggml_type: GGMLType) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml storage type."""
    size = BLOCK_SIZES.get(ggml_type)
    if size is None:
        raise ValueError(
            f"ggml_type {ggml_type!r} is unknown; known: {[t.name for t in BLOCK_SIZES]}"
        )
    return size


def dequantize(raw: torch.Tensor, ggml_type: GGMLType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a tensor's stored bytes (uint8, any layout) into float32 of torch `shape`."""
    ggml_type = GGMLType(ggml_type)
    decoder = _DECODERS.get(ggml_type)
    if decoder is None:
        raise ValueError(
            f"ggml_type {ggml_type.name} cannot be dequantized; supported: "
            f"{', '.join(t.name for t in _DECODERS)}"
        )
    block_elems, block_bytes = type_size(ggml_type)
    num_elems = 1
    for n in shape:
        num_elems *= n
    if num_elems % block_elems != 0:
        raise ValueError(f"shape {shape} has {num_elems} elements, not a multiple of {block_elems}")
    num_blocks = num_elems // block_elems
    if raw.dtype != torch.uint8 or raw.numel() != num_blocks * block_bytes:
        raise ValueError(
            f"raw must be uint8 with {num_blocks * block_bytes} bytes for {ggml_type.name} "
            f"shape {shape}; got {raw.dtype} with {raw.numel()} elements"
        )
    blocks = raw.reshape(num_blocks, block_bytes)  # (N, block_bytes)
    return decoder(blocks).reshape(shape)


def q8_0_codes(raw: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's integer codes (rows, cols) int8 and per-32 scales (rows, cols // 32) float32.

    value = code * scale exactly; no float rounding happens on the way out.
    """
    if len(shape) < 1 or shape[-1] % 32 != 0:
        raise ValueError(f"shape {shape}: Q8_0 needs a last dimension that is a multiple of 32")
    cols = shape[-1]
    rows = 1
    for n in shape[:-1]:
        rows *= n
    if raw.dtype != torch.uint8 or raw.numel() != rows * cols // 32 * 34:
        raise ValueError(
            f"raw must be uint8 with {rows * cols // 32 * 34} bytes for Q8_0 shape {shape}; "
            f"got {raw.dtype} with {raw.numel()} elements"
        )
    blocks = raw.reshape(-1, 34)  # (N, 34)
    scales = _f16(blocks[:, 0:2]).reshape(rows, cols // 32)
    codes = blocks[:, 2:].contiguous().view(torch.int8).reshape(rows, cols)
    return codes, scales


# ---------------------------------------------------------------- field helpers


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(N, 2) uint8 little-endian fp16 -> (N, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    """(N, 4) uint8 little-endian fp32 -> (N, 1) float32."""
    return b.contiguous().view(torch.float32)


# ---------------------------------------------------------------- float types


def _dequant_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32).clone()


def _dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


# ---------------------------------------------------------------- 32-element blocks


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # Q8_0, 34 bytes -> 32 values:
    #   [0:2]  d   fp16 scale
    #   [2:34] qs  32 x int8 codes          value = d * q
    d = _f16(blocks[:, 0:2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d * q


_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.Q8_0: _dequant_q8_0,
}
