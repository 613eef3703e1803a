"""The C kernels build once into the cache directory, reload from it, and switch off cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.kernels import build, decoder


def test_builds_once_then_loads_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    lib = build._build_and_load("int8_gemm")
    assert lib is not None and hasattr(lib, "tidal_int8_gemm_f32")
    built = list((tmp_path / "kernels").glob("int8_gemm-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert build._build_and_load("int8_gemm") is not None
    assert built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert not list((tmp_path / "kernels").glob("*.tmp*"))


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_KERNELS", "0")
    assert build._build_and_load("int8_gemm") is None


def test_no_compiler_means_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_compiler", lambda: None)
    assert build._build_and_load("int8_gemm") is None


def test_a_failing_build_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_FLAGS", ("--no-such-option",))
    assert build._build_and_load("int8_gemm") is None
    assert not list((tmp_path / "kernels").iterdir())


def test_linked_sources_build_into_one_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decoder.c calls the gemm, attention and norm kernels directly: one library holds them all,
    reused from the cache like any other."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    link = decoder.LINKED
    lib = build._build_and_load("decoder", link)
    assert lib is not None
    for symbol in (
        "tidal_decoder_run",
        "tidal_gguf_gemm",
        "tidal_gguf_kdecode16",
        "tidal_paged_attention",
        "tidal_rms_norm",
    ):
        assert hasattr(lib, symbol)
    built = list((tmp_path / "kernels").glob("decoder-*.so"))
    assert len(built) == 1
    assert build._build_and_load("decoder", link) is not None
    assert list((tmp_path / "kernels").glob("decoder-*.so")) == built  # reused
