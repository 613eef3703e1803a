"""Compiles tidal's C kernels once per machine into the cache directory and loads them with ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent
# -march=native: the library is built on, and only used on, the machine that runs it (like
# llama.cpp's GGML_NATIVE); the cache key includes the CPU model so a copied cache rebuilds.
_FLAGS = ("-O3", "-march=native", "-mtune=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    base = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tidal"
    )
    return Path(base) / "kernels"


def _cpuinfo_field(name: str) -> str | None:
    """The first `name` line of /proc/cpuinfo (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or "unknown"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (avx2, fma, avx512f, ...); empty where /proc/cpuinfo is absent.
    Kernels pick their paths from these and from what their library was compiled with."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _digest(sources: list[Path], cc: str) -> str:
    """16 hex digits over the sources, the headers, the compiler, its flags and the CPU model."""
    headers = sorted(_SOURCES.glob("*.h"))
    return hashlib.sha256(
        b"\0".join(
            [p.read_bytes() for p in (*sources, *headers)]
            + [cc.encode(), " ".join(_FLAGS).encode(), _cpu_model().encode()]
        )
    ).hexdigest()[:16]


def identity() -> str:
    """What decides the numbers tidal's kernels give on this machine: a digest of every kernel
    source with the compiler, its flags and the CPU model, or "off" where no kernel can build
    (torch's fallbacks run). Results measured through the kernels (the accuracy gate's stored
    verdicts) key on it, so a changed kernel measures afresh."""
    cc = _compiler()
    if os.environ.get("TIDAL_KERNELS", "1") == "0" or cc is None:
        return "off"
    return _digest(sorted(_SOURCES.glob("*.c")), cc)


def load(name: str, link: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library for tidal/kernels/<name>.c, or None where it cannot be built (no C
    compiler, a failed build, TIDAL_KERNELS=0); callers then take their torch fallback.

    `link` names other kernel sources compiled into the same library, so that <name>.c can call
    their public functions directly (one C call that runs several kernels in turn)."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name, link)
        return _loaded[name]


def _build_and_load(name: str, link: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    if os.environ.get("TIDAL_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: the %s kernel is off, torch's fallback runs", name)
        return None
    sources = [_SOURCES / f"{n}.c" for n in (name, *link)]
    key = _digest(sources, cc)
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *_FLAGS, *map(str, sources), "-lm", "-o", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)  # atomic: a concurrent build never loads half a file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("building the %s kernel failed, torch's fallback runs: %s", name, detail)
            Path(tmp).unlink(missing_ok=True)
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        log.warning("loading %s failed, torch's fallback runs: %s", target, e)
        return None
