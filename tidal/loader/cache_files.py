"""Cache files derived from a checkpoint (tokenizer caches), and GPT-2's byte alphabet: what
tokenizer loaders share, without importing numpy or `tokenizers`."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def tidal_cache_dir() -> Path:
    """`$TIDAL_CACHE_DIR`, else `$XDG_CACHE_HOME/tidal`, else `~/.cache/tidal` (not created)."""
    explicit = os.environ.get("TIDAL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tidal"


def cache_candidates(model_path: Path, suffix: str) -> Sequence[Path]:
    """Where a cache derived from a checkpoint lives: beside a model file first, then under
    tidal's cache directory (only there for a directory: never inside a user's HF folder)."""
    # The name is per absolute path; the recorded key still guards against a replaced file.
    digest = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:16]
    central = tidal_cache_dir() / "tokenizers" / f"{model_path.name}-{digest}{suffix}"
    if model_path.is_dir():
        return (central,)
    return (model_path.with_name(model_path.name + suffix), central)


def write_cache_file(cache_path: Path, parts: Sequence[bytes]) -> bool:
    """Write `parts` to cache_path atomically (temp file + rename); False if it cannot be written."""
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=cache_path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                for part in parts:
                    f.write(part)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache holds nothing secret
            os.replace(tmp, cache_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return False
    return True
