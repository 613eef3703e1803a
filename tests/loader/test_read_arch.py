"""read_arch parses a GGUF header once per process while the file is unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.loader.test_weight_cache import write_tiny_quantized_gemma
from tidal.loader import model_loader
from tidal.loader.model_loader import read_arch


def test_the_header_is_parsed_once_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_quantized_gemma(path)
    opened: list[str] = []
    from tidal.loader import gguf_file

    real = gguf_file.GGUFFile

    class CountingGGUFFile(real):  # the real reader, counting its opens
        def __init__(self, p: str | os.PathLike[str], **kwargs: object) -> None:
            opened.append(str(p))
            super().__init__(p, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_file, "GGUFFile", CountingGGUFFile)
    model_loader._read_gguf_header.cache_clear()
    first = read_arch(path)
    assert read_arch(str(path)) == first and len(opened) == 1
    assert first[0].family == "gemma3" and first[0].num_layers == 2 and first[1] == "gemma3"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert read_arch(path) == first and len(opened) == 2  # re-read: same content, same arch


def test_a_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_arch(tmp_path / "nope.gguf")


def test_the_torch_free_reader_gives_the_same_arch(tmp_path: Path) -> None:
    """The API process reads the architecture without torch; it must agree with the loader's."""
    from tests.server.tiny_server import make_tiny_checkpoint
    from tidal.loader.arch_reader import read_arch_config

    gguf = tmp_path / "tiny.gguf"
    write_tiny_quantized_gemma(gguf)
    hf_dir = make_tiny_checkpoint(tmp_path / "hf")
    for path in (gguf, hf_dir):
        assert read_arch_config(path) == read_arch(path)[0]
    for bad in (tmp_path / "missing.gguf", tmp_path):
        with pytest.raises(ValueError, match="does not exist|without config.json"):
            read_arch_config(bad)
