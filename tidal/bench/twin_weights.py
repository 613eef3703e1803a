"""Synthetic tensor data in ggml's block types: random codes under scale fields that make the
values zero-mean with a chosen spread, written chunk by chunk at memory speed.

Each block is random bytes with its scale fields overwritten by constants (value = what
tidal/quant/gguf_dequant.py decodes; q a code, uniform over its range, so its std is
sqrt((levels^2 - 1) / 12)):

    Q8_0, Q4_0, Q5_0   d * (q - mid)          d = std / std(q), its sign alternating block by block
                                              (the codes' mean sits half a step below mid)
    Q4_1, Q5_1         d * q + m              m = -d * mean(q)
    Q4_K               d * sc * q - dmin * m  sc = 8, m = 60, dmin = d: 8 * 7.5 = 60, mean 0
    Q5_K               the same               sc = 4, m = 62, dmin = d: 4 * 15.5 = 62
    Q6_K               d * sc * (q - 32)      sc = +8, -8, ... over the 16 sub-blocks
    F32, F16           normal(0, std)

Biases are 0 and the other vectors (norm weights; rope factors unless given) 1.0, F32 as
convert_hf_to_gguf.py stores them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from tidal.bench.twin_header import TensorSpec
from tidal.quant.gguf_types import BLOCK_SIZES, GGMLType

MATRIX_STD = 0.02  # a 7B model's weights: activations stay finite through 28+ random layers
CHUNK_BYTES = 16 << 20


def _code_std(levels: int) -> float:
    return math.sqrt((levels * levels - 1) / 12)


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def k_scales(sc: Sequence[int], mins: Sequence[int]) -> bytes:
    """Q4_K/Q5_K's 12 bytes holding eight 6-bit scales and eight 6-bit mins (gguf_dequant's
    _k_scale_min reads them back): bytes 0-3 and 4-7 the low six bits of sc 0-3 and m 0-3 with
    the top two bits of sc 4-7 and m 4-7 above them, bytes 8-11 the low nibbles of sc/m 4-7."""
    out = bytearray(12)
    for j in range(4):
        out[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        out[j + 4] = (mins[j] & 63) | ((mins[j + 4] >> 4) << 6)
        out[j + 8] = (sc[j + 4] & 15) | ((mins[j + 4] & 15) << 4)
    return bytes(out)


def block_fields(ggml_type: GGMLType, std: float) -> tuple[int, bytes, bytes]:
    """(offset, bytes for even blocks, bytes for odd blocks): the scale fields every block of
    this type gets, over random codes, for zero-mean values of spread `std`."""
    t = GGMLType(ggml_type)
    if t in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0):
        levels = {GGMLType.Q8_0: 256, GGMLType.Q4_0: 16, GGMLType.Q5_0: 32}[t]
        d = std / _code_std(levels)
        return 0, _f16(d), _f16(-d)
    if t in (GGMLType.Q4_1, GGMLType.Q5_1):
        levels = 16 if t == GGMLType.Q4_1 else 32
        d = float(np.float16(std / _code_std(levels)))
        field = _f16(d) + _f16(-d * (levels - 1) / 2)
        return 0, field, field
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, m, levels = (8, 60, 16) if t == GGMLType.Q4_K else (4, 62, 32)
        d = _f16(std / (sc * _code_std(levels)))
        field = d + d + k_scales([sc] * 8, [m] * 8)  # d | dmin | scales
        return 0, field, field
    if t == GGMLType.Q6_K:
        sc = 8
        scales = np.array([sc, -sc] * 8, dtype=np.int8).tobytes()
        field = scales + _f16(std / (sc * _code_std(64)))  # scales | d, after ql and qh
        return 192, field, field
    raise ValueError(f"ggml_type {t.name} cannot be synthesized; supported: {SYNTH_TYPES}")


SYNTH_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class RandomBytes:
    """Uniform random bytes at memory speed: two windows of one seeded pool XORed (bytes of a
    tensor are then uniform, as independent as a weight benchmark needs), into one reused buffer."""

    def __init__(self, seed: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.rng = np.random.default_rng(seed)
        self.chunk_bytes = chunk_bytes
        self._pool = self.rng.bit_generator.random_raw(-(-2 * chunk_bytes // 8)).view(np.uint8)
        self._out = np.empty(chunk_bytes, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` (at most chunk_bytes) random bytes, valid until the next call."""
        a = int(self.rng.integers(0, self.chunk_bytes + 1))
        b = (a + 1 + int(self.rng.integers(0, self.chunk_bytes))) % (self.chunk_bytes + 1)
        out = self._out[:nbytes]
        np.bitwise_xor(self._pool[a : a + nbytes], self._pool[b : b + nbytes], out=out)
        return out


def tensor_chunks(
    spec: TensorSpec,
    source: RandomBytes,
    values: Sequence[float] | None = None,
    std: float = MATRIX_STD,
) -> Iterator[np.ndarray]:
    """The tensor's bytes, chunk by chunk (each valid until the next is asked for): `values` if
    given, zeros for a bias, ones for another vector, else zero-mean values of spread `std`."""
    t = spec.ggml_type
    if t in (GGMLType.F32, GGMLType.F16):
        yield from _float_chunks(spec, source, values, std)
        return
    if values is not None or spec.name.endswith(("_norm.weight", ".bias")):
        raise ValueError(f"tensor {spec.name!r}: fixed values need F32 or F16, not {t.name}")
    _, block_bytes = BLOCK_SIZES[t]
    offset, even, odd = block_fields(t, std)
    per_chunk = max(2, source.chunk_bytes // block_bytes // 2 * 2)  # even: the signs alternate
    num_blocks = spec.nbytes // block_bytes
    for start in range(0, num_blocks, per_chunk):
        count = min(per_chunk, num_blocks - start)
        blocks = source.take(count * block_bytes).reshape(count, block_bytes)  # (blocks, bytes)
        blocks[0::2, offset : offset + len(even)] = np.frombuffer(even, np.uint8)
        blocks[1::2, offset : offset + len(odd)] = np.frombuffer(odd, np.uint8)
        yield blocks.reshape(-1)


def _float_chunks(
    spec: TensorSpec, source: RandomBytes, values: Sequence[float] | None, std: float
) -> Iterator[np.ndarray]:
    dtype = np.float32 if spec.ggml_type == GGMLType.F32 else np.float16
    n = spec.num_elements
    if values is not None:
        if len(values) != n:
            raise ValueError(f"tensor {spec.name!r}: {len(values)} values for {n} elements")
        yield np.asarray(values, dtype=dtype).view(np.uint8)
        return
    # biases 0; the other vectors (norm weights, rope factors) 1; matrices random
    fill = 0.0 if spec.name.endswith(".bias") else 1.0 if len(spec.shape) == 1 else None
    step = max(1, source.chunk_bytes // np.dtype(dtype).itemsize)
    for start in range(0, n, step):
        count = min(step, n - start)
        if fill is not None:
            chunk = np.full(count, fill, dtype=dtype)
        else:
            chunk = (source.rng.standard_normal(count, dtype=np.float32) * std).astype(dtype)
        yield chunk.view(np.uint8)
