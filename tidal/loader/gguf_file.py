"""A fast memory-mapped reader for GGUF (v2 and v3) files: metadata, tensor infos and raw bytes."""

from __future__ import annotations

import array
import enum
import mmap
import os
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.quant.gguf_types import BLOCK_SIZES, GGMLType

# NOTE: numpy and torch are imported only where a file's tensors or numpy arrays are wanted: the
# API process reads the metadata (the tokenizer's family, the architecture) through this module
# with header_only=True and pays neither's import and memory.
if TYPE_CHECKING:
    import numpy as np
    import torch

GGUF_MAGIC = b"GGUF"
# Readers of the architecture decode string arrays up to this many items (general.tags, say)
# and only count longer ones (the vocabulary, its merges)
ARCH_STRINGS_DECODED = 1024
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class _ValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# A metadata array's element type: its little-endian struct code (also the array.array
# typecode, bool read as "B") and numpy dtype. Explicit codes: numpy's dtype.char for 64-bit
# ints is platform-sized ("l"/"L").
_ELEMENTS: dict[_ValueType, tuple[str, str]] = {
    _ValueType.UINT8: ("B", "<u1"),
    _ValueType.INT8: ("b", "<i1"),
    _ValueType.UINT16: ("H", "<u2"),
    _ValueType.INT16: ("h", "<i2"),
    _ValueType.UINT32: ("I", "<u4"),
    _ValueType.INT32: ("i", "<i4"),
    _ValueType.FLOAT32: ("f", "<f4"),
    _ValueType.BOOL: ("?", "?"),
    _ValueType.UINT64: ("Q", "<u8"),
    _ValueType.INT64: ("q", "<i8"),
    _ValueType.FLOAT64: ("d", "<f8"),
}
_SCALAR_STRUCTS: dict[_ValueType, struct.Struct] = {
    vt: struct.Struct("<" + code) for vt, (code, _) in _ELEMENTS.items()
}

# The float types a GGUF may store a tensor in, by torch dtype name.
_TORCH_STORAGE: dict[GGMLType, str] = {
    GGMLType.F32: "float32",
    GGMLType.F16: "float16",
    GGMLType.BF16: "bfloat16",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]  # torch/numpy order: ggml's ne reversed
    offset: int  # absolute byte offset in the file
    nbytes: int


class CountedStrings:
    """A string array read for its length only (GGUFFile(..., count_strings_over=N)): `len()`
    works, the strings were never decoded (arch_from_gguf needs the vocabulary's size, not
    its 262k tokens)."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"CountedStrings({self.count})"


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; errors name the path."""

    __slots__ = ("buf", "pos", "size", "path", "count_strings_over", "numpy_arrays")

    def __init__(
        self,
        buf: memoryview,
        path: Path,
        count_strings_over: int | None = None,
        numpy_arrays: bool = True,
    ) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path
        self.count_strings_over = count_strings_over
        self.numpy_arrays = numpy_arrays

    def need(self, nbytes: int, what: str) -> None:
        if self.pos + nbytes > self.size:
            raise ValueError(
                f"{self.path}: truncated GGUF file: reading {what} needs {nbytes} bytes at "
                f"offset {self.pos}, but the file is {self.size} bytes"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self, what: str) -> str:
        length = self.u64(what)
        self.need(length, what)
        start = self.pos
        self.pos += length
        return _decode(self.buf[start : self.pos])

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _ValueType.STRING:
            return self.string(what)
        if vtype == _ValueType.ARRAY:
            return self.array(what)
        packer = _SCALAR_STRUCTS.get(vtype)  # type: ignore[call-overload]
        if packer is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} in {what}")
        self.need(packer.size, what)
        (value,) = packer.unpack_from(self.buf, self.pos)
        self.pos += packer.size
        return value

    def array(self, what: str) -> Any:
        elem_type = self.u32(what)
        count = self.u64(what)
        element = _ELEMENTS.get(elem_type)  # type: ignore[call-overload]
        if element is not None:
            code, dtype = element
            nbytes = count * _SCALAR_STRUCTS[elem_type].size  # type: ignore[index]
            self.need(nbytes, what)
            # Copied, so metadata outlives the mapping.
            raw = self.buf[self.pos : self.pos + nbytes]
            self.pos += nbytes
            if self.numpy_arrays:
                import numpy as np

                return np.frombuffer(raw, dtype=np.dtype(dtype)).copy()
            return _python_array(raw, code)
        if elem_type == _ValueType.STRING:
            if self.count_strings_over is not None and count > self.count_strings_over:
                return self.skip_strings(count, what)
            return self.string_array(count, what)
        if elem_type == _ValueType.ARRAY:
            return [self.array(what) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF array element type {elem_type} in {what}")

    def string_array(self, count: int, what: str) -> list[str]:
        # The hot loop of opening a file (a 262k-token vocabulary). Items are parsed out of
        # one bytes copy of the region (grown by doubling) because slicing bytes is a single
        # allocation where a memoryview slice plus bytes() is two; this halves open time.
        start = self.pos
        window = b""
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        rel = 0  # position relative to start
        for _ in range(count):
            if rel + 8 > len(window):
                window = self._window(start, rel + 8, len(window), count, what)
            (length,) = unpack(window, rel)
            rel += 8
            end = rel + length
            if end > len(window):
                window = self._window(start, end, len(window), count, what)
            item = window[rel:end]
            try:
                append(item.decode("utf-8"))
            except UnicodeDecodeError:
                # NOTE: some vocabularies hold byte tokens that are not valid UTF-8 alone;
                # surrogateescape keeps them lossless (encode back with the same handler).
                append(item.decode("utf-8", errors="surrogateescape"))
            rel = end
        self.pos = start + rel
        return out

    def skip_strings(self, count: int, what: str) -> CountedStrings:
        """Step over `count` strings without decoding them (a third of string_array's time)."""
        unpack, buf, pos, size = _U64.unpack_from, self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                break
            (length,) = unpack(buf, pos)
            if pos + 8 + length > size:
                break
            pos += 8 + length
        else:
            self.pos = pos
            return CountedStrings(count)
        self.pos = pos
        self.need(size - pos + 1, what)  # the file ends inside the array: raises
        raise AssertionError("unreachable")

    def _window(self, start: int, needed: int, current: int, count: int, what: str) -> bytes:
        """bytes of [start, start + n) with n >= needed, about double the current window."""
        if start + needed > self.size:
            self.pos = start
            self.need(needed, what)
        wanted = max(needed, 2 * current, count * 24)  # 24: a typical token plus its length
        return bytes(self.buf[start : min(self.size, start + wanted)])


def _python_array(raw: memoryview, code: str) -> array.array:
    """A numeric metadata array without numpy (GGUFFile(..., header_only=True)): indexing,
    len() and tolist() as a numpy array's; bools read as 0/1."""
    values = array.array("B" if code == "?" else code)
    if values.itemsize != struct.calcsize(code):  # "I" is 4 bytes wherever tidal runs
        raise ValueError(f"array.array({code!r}) is {values.itemsize} bytes on this platform")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _decode(raw: memoryview) -> str:
    data = bytes(raw)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        # NOTE: as in _Cursor.string_array, keep invalid UTF-8 lossless.
        return data.decode("utf-8", errors="surrogateescape")


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a file's tensors are: what a reader of tensor bytes needs, without the metadata."""

    version: int
    tensors: dict[str, GGUFTensorInfo]  # never modified (GGUFFile copies it)
    data_offset: int


# NOTE: a per-process memo of the last few files' layouts, by file identity (path, size, mtime,
# inode, device). Parsing a header costs ~0.1 s for a 262k-token vocabulary; an engine reads
# the header for its architecture (memoized in model_loader) and then opens the file again for
# the tensors alone, so that second open, with metadata=False, parses nothing. A layout is
# small (a few hundred tensor infos); the metadata it omits is what would be large.
_LAYOUTS: OrderedDict[tuple[str, int, int, int, int], _Layout] = OrderedDict()
_LAYOUTS_KEPT = 4


class _Unread(dict):
    """The metadata of a GGUFFile opened with metadata=False: any read is a mistake."""

    def _refuse(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError("this GGUFFile was opened with metadata=False; its metadata is unread")

    __getitem__ = get = __contains__ = keys = values = items = __iter__ = __len__ = _refuse


class GGUFFile:
    """An open GGUF file: parsed metadata and tensor infos, tensor bytes read lazily via mmap.

    The mapping is copy-on-write: arrays from `raw()` are writable views, and writes to
    them never reach the file. Views stay valid after `close()` (they keep the mapping alive).

    `metadata=False`: the caller reads tensors only; where this process has parsed the same file
    before (same size, mtime and inode), the header is not parsed again and `metadata` refuses
    reads. `count_strings_over=N`: a string array of more than N items is stepped over, not
    decoded, and its metadata value is a CountedStrings (its length only): for readers that
    need the vocabulary's size, not its tokens. `header_only=True`: the metadata and tensor
    infos, read without numpy and keeping no mapping (numeric metadata arrays are
    array.array; `raw()` and `load_tensor()` refuse): for the API process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: bool = True,
        count_strings_over: int | None = None,
        header_only: bool = False,
    ) -> None:
        if header_only and not metadata:
            raise ValueError("GGUFFile(header_only=True) reads the metadata: metadata=False is not")
        self.path = Path(path)
        self.header_only = header_only
        st = self.path.stat()
        file_bytes = st.st_size
        if file_bytes < 24:
            raise ValueError(
                f"{self.path}: not a GGUF file: {file_bytes} bytes is shorter than the 24-byte header"
            )
        identity = (str(self.path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        self._data: np.ndarray | None = None
        if header_only:
            # Unmapped when the last view of it goes, at the end of this call.
            with open(self.path, "rb") as fh:
                view = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
        else:
            import numpy as np

            self._data = np.memmap(self.path, dtype=np.uint8, mode="c")
            view = memoryview(self._data)
        layout = None if metadata else _LAYOUTS.get(identity)
        if layout is not None:
            self.version, self.data_offset = layout.version, layout.data_offset
            self.tensors: dict[str, GGUFTensorInfo] = dict(layout.tensors)
            self.metadata: dict[str, Any] = _Unread()
            return
        cursor = _Cursor(view, self.path, count_strings_over, numpy_arrays=not header_only)
        magic = bytes(view[:4])
        if magic != GGUF_MAGIC:
            raise ValueError(
                f"{self.path}: not a GGUF file: magic {magic!r}, expected {GGUF_MAGIC!r}"
            )
        cursor.pos = 4
        self.version = cursor.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise ValueError(
                f"{self.path}: unsupported GGUF version {self.version}{hint}; "
                f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        num_tensors = cursor.u64("tensor count")
        num_kv = cursor.u64("metadata count")

        self.metadata = {}
        for _ in range(num_kv):
            key = cursor.string("metadata key")
            vtype = cursor.u32(f"type of metadata {key!r}")
            self.metadata[key] = cursor.value(vtype, f"metadata {key!r}")

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            raise ValueError(
                f"{self.path}: general.alignment is {alignment!r}; expected a positive integer"
            )

        pending: list[tuple[str, GGMLType, tuple[int, ...], int, int]] = []
        for _ in range(num_tensors):
            name = cursor.string("tensor name")
            n_dims = cursor.u32(f"dims of tensor {name!r}")
            ne = [cursor.u64(f"shape of tensor {name!r}") for _ in range(n_dims)]
            type_id = cursor.u32(f"type of tensor {name!r}")
            rel_offset = cursor.u64(f"offset of tensor {name!r}")
            ggml_type = _ggml_type(type_id, name, self.path)
            pending.append(
                (
                    name,
                    ggml_type,
                    tuple(reversed(ne)),
                    rel_offset,
                    _nbytes(ggml_type, ne, name, self.path),
                )
            )

        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors = {}
        for name, ggml_type, shape, rel_offset, nbytes in pending:
            offset = data_start + rel_offset
            if offset + nbytes > file_bytes:
                raise ValueError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                    f"[{offset}, {offset + nbytes}) but the file is {file_bytes} bytes"
                )
            self.tensors[name] = GGUFTensorInfo(name, ggml_type, shape, offset, nbytes)
        self.data_offset = data_start
        _LAYOUTS[identity] = _Layout(self.version, dict(self.tensors), data_start)
        _LAYOUTS.move_to_end(identity)
        while len(_LAYOUTS) > _LAYOUTS_KEPT:
            _LAYOUTS.popitem(last=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(
                f"{self.path}: metadata general.architecture is missing or not a string"
            )
        return arch

    def _info(self, name: str) -> GGUFTensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a uint8 view into the mapping (no copy)."""
        if self._data is None:
            state = "opened with header_only=True" if self.header_only else "closed"
            raise ValueError(f"{self.path}: file is {state}: no tensor bytes to read")
        info = self._info(name)
        return self._data[info.offset : info.offset + info.nbytes]

    def load_tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized, in torch shape, as a fresh tensor of `dtype` (float32 if None)."""
        import torch

        # Imported here because gguf_quants imports GGMLType from this module.
        from tidal.quant.gguf_dequant import dequantize

        dtype = torch.float32 if dtype is None else dtype
        info = self._info(name)
        raw = torch.from_numpy(self.raw(name))
        stored = _TORCH_STORAGE.get(info.ggml_type)
        if stored is not None and getattr(torch, stored) == dtype:
            # Already stored in the wanted dtype: skip the float32 round trip.
            return raw.view(dtype).reshape(info.shape).clone()
        return dequantize(raw, info.ggml_type, info.shape).to(dtype)

    def close(self) -> None:
        # Dropping the reference unmaps once no view from raw() is alive.
        self._data = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, version={self.version}, tensors={len(self.tensors)})"


def _ggml_type(type_id: int, name: str, path: Path) -> GGMLType:
    try:
        return GGMLType(type_id)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None


def _nbytes(ggml_type: GGMLType, ne: list[int], name: str, path: Path) -> int:
    block_elems, block_bytes = BLOCK_SIZES[ggml_type]
    num_elems = 1
    for n in ne:
        num_elems *= n
    if ne and ne[0] % block_elems != 0:
        raise ValueError(
            f"{path}: tensor {name!r} has row length {ne[0]}, not a multiple of the "
            f"{ggml_type.name} block size {block_elems}"
        )
    return num_elems // block_elems * block_bytes
