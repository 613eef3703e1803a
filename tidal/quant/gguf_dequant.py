"""Vectorized torch dequantizers for ggml tensor storage types (one function per block layout)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.quant.gguf_types import BLOCK_SIZES, GGMLType

CHUNK_ELEMS = 1 << 20  # values decoded per slice: 4 MiB of float32, few parallel regions


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
    out = torch.empty(num_blocks, block_elems, dtype=torch.float32)
    # Decode in cache-sized slices: each decoder makes several temporaries, and at full
    # size (a 167M-element embedding) those cost more in page faults than in arithmetic.
    step = max(1, CHUNK_ELEMS // block_elems)
    for start in range(0, num_blocks, step):
        out[start : start + step] = decoder(blocks[start : start + step])
    return out.reshape(shape)


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
    #   [0:2]   d    fp16 scale
    #   [2:34]  qs   32 x int8              value[i] = d * qs[i]
    d = _f16(blocks[:, 0:2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d * q


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) packed bytes -> (N, 32) uint8: low nibbles are values 0..15, high are 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """(N, k) bytes -> (N, k*8) uint8 of 0/1, bit j of byte i at position i*8 + j (little-endian)."""
    return ((b.unsqueeze(-1) >> _SHIFTS_1) & 1).reshape(b.shape[0], -1)


_SHIFTS_1 = torch.arange(8, dtype=torch.uint8)
_SHIFTS_2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # Q4_0, 18 bytes -> 32 values:
    #   [0:2]   d    fp16 scale
    #   [2:18]  qs   16 bytes; byte j holds value j (low nibble) and value j+16 (high nibble)
    #   value = d * (q - 8)
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:18]).float() - 8.0
    return d * q


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # Q4_1, 20 bytes -> 32 values:
    #   [0:2]   d    fp16 scale
    #   [2:4]   m    fp16 offset (the block minimum)
    #   [4:20]  qs   16 bytes of nibbles as in Q4_0
    #   value = d * q + m
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    return d * _nibbles(blocks[:, 4:20]).float() + m


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # Q5_0, 22 bytes -> 32 values:
    #   [0:2]   d    fp16 scale
    #   [2:6]   qh   32 bits, little-endian: bit i is bit 4 of value i
    #   [6:22]  qs   16 bytes of low nibbles as in Q4_0
    #   value = d * ((qh_i << 4 | nibble_i) - 16)
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 6:22]) | (_bits(blocks[:, 2:6]) << 4)
    return d * (q.float() - 16.0)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # Q5_1, 24 bytes -> 32 values:
    #   [0:2] d fp16 | [2:4] m fp16 | [4:8] qh 32 high bits | [8:24] qs low nibbles
    #   value = d * (qh_i << 4 | nibble_i) + m
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:24]) | (_bits(blocks[:, 4:8]) << 4)
    return d * q.float() + m


# ---------------------------------------------------------------- 256-element super-blocks


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> eight 6-bit scales and eight 6-bit mins, (N, 8) each.

    byte  0..3: [mins' bits 4-5 of sc 4..7 | sc 0..3 (6 bits)]      row a
    byte  4..7: [bits 4-5 of mn 4..7      | mn 0..3 (6 bits)]       row b
    byte 8..11: [mn 4..7 low nibble (hi)  | sc 4..7 low nibble (lo)] row c
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q4_K, 144 bytes -> 256 values in 8 sub-blocks of 32:
    #   [0:2]     d       fp16 super-scale for the scales
    #   [2:4]     dmin    fp16 super-scale for the mins
    #   [4:16]    scales  8 x 6-bit scale + 8 x 6-bit min (see _k_scale_min)
    #   [16:144]  qs      4 chunks of 32 bytes; chunk c holds sub-block 2c (low nibbles)
    #                     and sub-block 2c+1 (high nibbles)
    #   value = (d * sc_s) * q - (dmin * mn_s)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    q = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F  # (N, 4, 2, 32)
    q = q.reshape(n, 8, 32).float()
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(n, 256)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q5_K, 176 bytes -> 256 values in 8 sub-blocks of 32:
    #   [0:2] d fp16 | [2:4] dmin fp16 | [4:16] scales as Q4_K
    #   [16:48]   qh  32 bytes; bit s of byte i is bit 4 of value s*32 + i
    #   [48:176]  qs  low nibbles laid out as Q4_K
    #   value = (d * sc_s) * (qh << 4 | nibble) - (dmin * mn_s)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qs = blocks[:, 48:176].reshape(n, 4, 1, 32)
    low = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F).reshape(
        n, 8, 32
    )
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> _SHIFTS_1.view(1, 8, 1)) & 1  # (N, 8, 32)
    q = (low | (high << 4)).float()
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(n, 256)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q6_K, 210 bytes -> 256 values in 16 sub-blocks of 16, as two halves of 128:
    #   [0:128]    ql      64 bytes per half: byte i holds the low nibbles of values i
    #                      (low) and i+64 (high) of that half
    #   [128:192]  qh      32 bytes per half: bits 2k..2k+1 of byte i are bits 4-5 of value k*32 + i
    #   [192:208]  scales  16 x int8, one per 16 values
    #   [208:210]  d       fp16 super-scale
    #   value = (d * scale_s) * ((qh << 4 | ql) - 32)
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
    low = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F).reshape(
        n, 2, 128
    )
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> _SHIFTS_2.view(1, 1, 4, 1)) & 0x03).reshape(n, 2, 128)
    q = ((low | (high << 4)).float() - 32.0).reshape(n, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (N, 16)
    d = _f16(blocks[:, 208:210])
    return ((d * scales).unsqueeze(-1) * q).reshape(n, 256)


def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q2_K, 84 bytes -> 256 values in 16 sub-blocks of 16:
    #   [0:16]   scales  byte s: low nibble = scale of sub-block s, high nibble = its min
    #   [16:80]  qs      2 halves of 32 bytes; bits 2k..2k+1 of byte i = value half*128 + k*32 + i
    #   [80:82]  d       fp16 super-scale for the scales
    #   [82:84]  dmin    fp16 super-scale for the mins
    #   value = (d * scale_s) * q - (dmin * min_s)
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)  # (N, 16, 1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFTS_2.view(1, 1, 4, 1)) & 0x03
    q = q.reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q3_K, 110 bytes -> 256 values in 16 sub-blocks of 16:
    #   [0:32]    hmask   bit k of byte i: 1 means value k*32 + i has no -4 offset
    #   [32:96]   qs      2 bits per value laid out as Q2_K
    #   [96:108]  scales  16 x 6 bits: low nibbles in bytes 0..7 (scales 0..7 low, 8..15 high),
    #                     top 2 bits in bytes 8..11 (bits 2k..2k+1 of byte j -> scale k*4 + j)
    #   [108:110] d       fp16 super-scale
    #   value = (d * (scale_s - 32)) * (q - 4 * (1 - hbit))
    n = blocks.shape[0]
    raw_scales = blocks[:, 96:108]
    low = torch.cat([raw_scales[:, 0:8] & 0x0F, raw_scales[:, 0:8] >> 4], dim=1)  # (N, 16)
    high = ((raw_scales[:, 8:12].reshape(n, 1, 4) >> _SHIFTS_2.view(1, 4, 1)) & 0x03).reshape(n, 16)
    scales = (low | (high << 4)).float() - 32.0
    d = _f16(blocks[:, 108:110])
    ql = ((blocks[:, 32:96].reshape(n, 2, 1, 32) >> _SHIFTS_2.view(1, 1, 4, 1)) & 0x03).reshape(
        n, 256
    )
    hbit = ((blocks[:, 0:32].reshape(n, 1, 32) >> _SHIFTS_1.view(1, 8, 1)) & 1).reshape(n, 256)
    q = ql.float() - 4.0 * (1 - hbit).float()
    return ((d * scales).unsqueeze(-1) * q.reshape(n, 16, 16)).reshape(n, 256)


def _dequant_q8_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q8_K, 292 bytes -> 256 values:
    #   [0:4]     d      fp32 scale
    #   [4:260]   qs     256 x int8          value = d * q
    #   [260:292] bsums  16 x int16 sums of groups of 16 (for dot products; unused here)
    return _f32(blocks[:, 0:4]) * blocks[:, 4:260].contiguous().view(torch.int8).float()


# ---------------------------------------------------------------- non-linear and ternary codes

# IQ4's 16 levels: a 4-bit code indexes this table instead of being used as a number.
_IQ4_LEVELS = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)
# MXFP4's e2m1 values, doubled to integers (the scale below is halved to match).
_MXFP4_LEVELS = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32
)


def _dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # IQ4_NL, 18 bytes -> 32 values, laid out as Q4_0:
    #   [0:2]   d    fp16 scale
    #   [2:18]  qs   16 bytes; byte j holds code j (low nibble) and code j+16 (high nibble)
    #   value = d * LEVELS[code]
    return _f16(blocks[:, 0:2]) * _IQ4_LEVELS[_nibbles(blocks[:, 2:18]).long()]


def _dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # IQ4_XS, 136 bytes -> 256 values in 8 sub-blocks of 32:
    #   [0:2]    d         fp16 super-scale
    #   [2:4]    scales_h  u16 little-endian: bits 2s..2s+1 are bits 4-5 of sub-block s's scale
    #   [4:8]    scales_l  byte s//2: low nibble = bits 0-3 of scale 2k, high nibble of 2k+1
    #   [8:136]  qs        16 bytes per sub-block, nibbles laid out as IQ4_NL
    #   value = d * (scale_s - 32) * LEVELS[code]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    high = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # (N, 1)
    high = (high >> (2 * torch.arange(8, dtype=torch.int32))) & 3  # (N, 8)
    low = torch.stack([blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4], dim=2).reshape(n, 8)
    scales = (low.to(torch.int32) | (high << 4)).float() - 32.0  # (N, 8)
    qs = blocks[:, 8:136].reshape(n * 8, 16)
    codes = _IQ4_LEVELS[_nibbles(qs).long()].reshape(n, 8, 32)
    return ((d * scales).unsqueeze(-1) * codes).reshape(n, 256)


def _dequant_tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    # TQ2_0, 66 bytes -> 256 ternary values:
    #   [0:64]   qs  2 halves of 32 bytes; bits 2k..2k+1 of byte i = value half*128 + k*32 + i
    #   [64:66]  d   fp16 scale
    #   value = d * (q - 1), q in {0, 1, 2}
    n = blocks.shape[0]
    q = (blocks[:, 0:64].reshape(n, 2, 1, 32) >> _SHIFTS_2.view(1, 1, 4, 1)) & 0x03
    return _f16(blocks[:, 64:66]) * (q.reshape(n, 256).float() - 1.0)


_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)


def _base3_digits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(N, k) bytes holding `count` base-3 digits each, scaled to 0..255 -> (N, count, k) in 0..2.

    Digit t of byte b is the top trit of (b * 3^t mod 256): ((b * 3^t) & 0xFF) * 3 >> 8.
    """
    scaled = (packed.to(torch.int32).unsqueeze(1) * _POW3[:count].view(1, count, 1)) & 0xFF
    return (scaled * 3) >> 8


def _dequant_tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    # TQ1_0, 54 bytes -> 256 ternary values:
    #   [0:32]   qs  5 trits per byte: trit t of byte m is value t*32 + m          (160 values)
    #   [32:48]  qs  5 trits per byte: trit t of byte m is value 160 + t*16 + m    (80 values)
    #   [48:52]  qh  4 trits per byte: trit t of byte m is value 240 + t*4 + m     (16 values)
    #   [52:54]  d   fp16 scale
    #   value = d * (trit - 1)
    n = blocks.shape[0]
    q = torch.cat(
        [
            _base3_digits(blocks[:, 0:32], 5).reshape(n, 160),
            _base3_digits(blocks[:, 32:48], 5).reshape(n, 80),
            _base3_digits(blocks[:, 48:52], 4).reshape(n, 16),
        ],
        dim=1,
    )
    return _f16(blocks[:, 52:54]) * (q.float() - 1.0)


def _dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # MXFP4, 17 bytes -> 32 values:
    #   [0]     e   E8M0 shared exponent: scale 2^(e - 127), halved for the doubled levels
    #   [1:17]  qs  16 bytes of e2m1 codes, nibbles laid out as Q4_0
    #   value = 2^(e - 128) * LEVELS[code]
    scale = torch.ldexp(torch.ones(1, dtype=torch.float64), blocks[:, 0:1].double() - 128.0)
    return scale.float() * _MXFP4_LEVELS[_nibbles(blocks[:, 1:17]).long()]


_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q2_K: _dequant_q2_k,
    GGMLType.Q3_K: _dequant_q3_k,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
    GGMLType.Q8_K: _dequant_q8_k,
    GGMLType.IQ4_NL: _dequant_iq4_nl,
    GGMLType.IQ4_XS: _dequant_iq4_xs,
    GGMLType.TQ1_0: _dequant_tq1_0,
    GGMLType.TQ2_0: _dequant_tq2_0,
    GGMLType.MXFP4: _dequant_mxfp4,
}
