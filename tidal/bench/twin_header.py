"""A GGUF header held as its encoded parts: metadata values byte for byte, tensor infos, the writer.

A layout twin copies a real file's header and writes new tensor data after it, so the metadata is
kept as GGUF encoded it (`MetaValue.payload`) and decoded only where a value is read. The tensor
infos' offsets are not kept: `encode_header` lays the tensors out again, in the order given, each
at the next multiple of the alignment, as llama.cpp and gguf-py do.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidal.quant.gguf_types import BLOCK_SIZES, GGMLType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13)
)
# the fixed-size types' little-endian struct codes (also array.array typecodes; bool as "B")
_CODES = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f",
          BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}  # fmt: skip
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class MetaValue:
    """One metadata key with its value as GGUF encodes it: the type tag and the payload bytes."""

    key: str
    vtype: int
    payload: bytes

    def value(self) -> Any:
        """The decoded value: str, int, float, bool, or a list (arrays)."""
        value, end = _decode(self.payload, 0, self.vtype)
        if end != len(self.payload):
            raise ValueError(f"metadata {self.key!r}: {len(self.payload) - end} bytes left over")
        return value


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a layout: name, torch-order shape (ggml's ne reversed), storage type."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType

    @property
    def num_elements(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count

    @property
    def nbytes(self) -> int:
        block_elems, block_bytes = BLOCK_SIZES[self.ggml_type]
        if self.shape[-1] % block_elems:
            raise ValueError(
                f"tensor {self.name!r}: row length {self.shape[-1]} is not a multiple of "
                f"{self.ggml_type.name}'s block of {block_elems}"
            )
        return self.num_elements // block_elems * block_bytes


@dataclass(frozen=True, slots=True)
class Header:
    """A GGUF header: version, metadata in file order, tensor infos in file order."""

    version: int
    metadata: tuple[MetaValue, ...]
    tensors: tuple[TensorSpec, ...]

    def get(self, key: str, default: Any = None) -> Any:
        for item in self.metadata:
            if item.key == key:
                return item.value()
        return default


def meta(key: str, value: Any, vtype: int, element_type: int | None = None) -> MetaValue:
    """Encode `value` as GGUF type `vtype` (ARRAY needs `element_type`)."""
    if vtype == ARRAY:
        if element_type is None:
            raise ValueError(f"metadata {key!r}: an ARRAY needs element_type")
        return MetaValue(key, ARRAY, _encode_array(value, element_type))
    return MetaValue(key, vtype, _encode(value, vtype))


def replace_value(metadata: Sequence[MetaValue], item: MetaValue) -> list[MetaValue]:
    """The metadata with `item` in place of the value of the same key (appended if absent)."""
    out = [item if m.key == item.key else m for m in metadata]
    if all(m.key != item.key for m in metadata):
        out.append(item)
    return out


def parse_header(buf: bytes | memoryview) -> tuple[Header, int]:
    """Read a GGUF header from the start of a file; returns it and the offset where its tensor
    infos end. Only the header's bytes are needed, not the tensor data."""
    view = memoryview(buf)
    if bytes(view[:4]) != GGUF_MAGIC:
        raise ValueError(f"not a GGUF header: magic {bytes(view[:4])!r}, expected {GGUF_MAGIC!r}")
    try:
        (version,) = _U32.unpack_from(view, 4)
        num_tensors, num_kv = struct.unpack_from("<QQ", view, 8)
        pos = 24
        metadata = []
        for _ in range(num_kv):
            key, pos = _decode(view, pos, STRING)
            (vtype,) = _U32.unpack_from(view, pos)
            start = pos + 4
            pos = _skip(view, start, vtype)
            metadata.append(MetaValue(key, vtype, bytes(view[start:pos])))
        tensors = []
        for _ in range(num_tensors):
            name, pos = _decode(view, pos, STRING)
            (n_dims,) = _U32.unpack_from(view, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", view, pos + 4)
            pos += 4 + 8 * n_dims
            (type_id,) = _U32.unpack_from(view, pos)
            pos += 4 + 8  # the type, then the data offset (laid out again on writing)
            tensors.append(TensorSpec(name, tuple(reversed(ne)), GGMLType(type_id)))
    except struct.error:
        raise ValueError(f"the GGUF header runs past the {len(view)} bytes given") from None
    if pos > len(view):
        raise ValueError(f"the GGUF header runs past the {len(view)} bytes given")
    return Header(version, tuple(metadata), tuple(tensors)), pos


def alignment_of(metadata: Sequence[MetaValue]) -> int:
    for item in metadata:
        if item.key == "general.alignment":
            return int(item.value())
    return DEFAULT_ALIGNMENT


def encode_header(
    metadata: Sequence[MetaValue], tensors: Sequence[TensorSpec], version: int = 3
) -> tuple[bytes, list[int]]:
    """The header's bytes, padded to the alignment, and each tensor's offset in the data section."""
    align = alignment_of(metadata)
    parts = [GGUF_MAGIC, struct.pack("<IQQ", version, len(tensors), len(metadata))]
    for item in metadata:
        parts += [_encode(item.key, STRING), _U32.pack(item.vtype), item.payload]
    offsets, offset = [], 0
    for spec in tensors:
        ne = tuple(reversed(spec.shape))
        parts += [_encode(spec.name, STRING), _U32.pack(len(ne)), struct.pack(f"<{len(ne)}Q", *ne)]
        parts += [_U32.pack(int(spec.ggml_type)), _U64.pack(offset)]
        offsets.append(offset)
        offset = -(-(offset + spec.nbytes) // align) * align
    header = b"".join(parts)
    return header + bytes(-len(header) % align), offsets


# ---------------------------------------------------------------- value encoding


def _encode(value: Any, vtype: int) -> bytes:
    if vtype == STRING:
        raw = value.encode("utf-8", errors="surrogateescape")
        return _U64.pack(len(raw)) + raw
    return struct.pack("<" + _CODES[vtype], value)


def _encode_array(values: Sequence[Any], element_type: int) -> bytes:
    head = _U32.pack(element_type) + _U64.pack(len(values))
    if element_type == STRING:
        return head + b"".join(_encode(v, STRING) for v in values)
    code = _CODES[element_type]
    packed = array.array("B" if code == "?" else code, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return head + packed.tobytes()


def _skip(buf: memoryview, pos: int, vtype: int) -> int:
    """The offset just past a value of type vtype starting at pos."""
    if vtype == STRING:
        return pos + 8 + _U64.unpack_from(buf, pos)[0]
    if vtype == ARRAY:
        (element_type,) = _U32.unpack_from(buf, pos)
        (count,) = _U64.unpack_from(buf, pos + 4)
        pos += 12
        if element_type in _CODES:
            return pos + count * struct.calcsize(_CODES[element_type])
        for _ in range(count):
            pos = _skip(buf, pos, element_type)
        return pos
    if vtype not in _CODES:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return pos + struct.calcsize(_CODES[vtype])


def _decode(buf: bytes | memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == STRING:
        end = pos + 8 + _U64.unpack_from(buf, pos)[0]
        if end > len(buf):
            raise struct.error("string past the end")
        return bytes(buf[pos + 8 : end]).decode("utf-8", errors="surrogateescape"), end
    if vtype == ARRAY:
        (element_type,) = _U32.unpack_from(buf, pos)
        (count,) = _U64.unpack_from(buf, pos + 4)
        pos += 12
        if element_type in _CODES:
            code = _CODES[element_type]
            end = pos + count * struct.calcsize(code)
            values = array.array("B" if code == "?" else code, bytes(buf[pos:end]))
            if sys.byteorder == "big":
                values.byteswap()
            return ([bool(v) for v in values] if code == "?" else values.tolist()), end
        items = []
        for _ in range(count):
            item, pos = _decode(buf, pos, element_type)
            items.append(item)
        return items, pos
    code = "<" + _CODES[vtype]
    return struct.unpack_from(code, buf, pos)[0], pos + struct.calcsize(code)
