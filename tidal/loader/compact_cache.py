"""The on-disk cache of compact tokenizers (TokenDecoder, CompactTokenizer): a checked one, or
the reason to keep the full tokenizer, stored beside the model (or under tidal's cache
directory) and keyed by the tokenizer files, the family, the format and the tokenizers release.

`load_cached_compact` reads it, and on a miss builds (optionally in a child process first, so
the caller never holds the full tokenizer), checks and writes it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tidal.loader.cache_files import cache_candidates, write_cache_file
from tidal.loader.token_decoder import TokenDecoder

log = logging.getLogger(__name__)

# A build in another process (load_cached_compact's build_command): Gemma 3's takes ~2.5 s.
_BUILD_TIMEOUT_S = 300.0
_MAGIC = b"TIDALTD\n"
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")


def _source_key(path: Path, family: str | None, fmt: int | str) -> dict[str, Any]:
    """What a cached tokenizer depends on: the checkpoint's tokenizer files (size, mtime), the
    family asked for, the file format and the tokenizers release it was checked against (read
    from the package's metadata: the process that only loads the cache never imports it)."""
    files = [path] if path.is_file() else [path / name for name in _HF_FILES]
    stats = []
    for f in files:
        try:
            st = f.stat()
            stats.append([f.name, st.st_size, st.st_mtime_ns])
        except OSError:
            stats.append([f.name, None, None])
    return {
        "format": fmt,
        "files": stats,
        "family": family,
        "tokenizers": importlib.metadata.version("tokenizers"),
    }


def _write_cache(cache_path: Path, key: dict[str, Any], result: TokenDecoder | str) -> bool:
    header: dict[str, Any] = {"source": key}
    arrays: list[bytes] = []
    if isinstance(result, str):
        header["unsupported"] = result
    else:
        fields, arrays = result.cache_parts()
        header.update(fields, sizes=[len(a) for a in arrays])
    head = json.dumps(header).encode("utf-8")
    return write_cache_file(cache_path, [_MAGIC, len(head).to_bytes(4, "little"), head, *arrays])


def _read_cache(
    cache_path: Path, key: dict[str, Any], load_full: Callable[[], Any], cls: type[TokenDecoder]
) -> TokenDecoder | str | None:
    """The cached tokenizer, the cached reason to keep the full one, or None (a miss)."""
    try:
        data = cache_path.read_bytes()
        if not data.startswith(_MAGIC):
            return None
        at = len(_MAGIC) + 4
        head_len = int.from_bytes(data[len(_MAGIC) : at], "little")
        header = json.loads(data[at : at + head_len])
        if header.get("source") != key:
            return None
        if "unsupported" in header:
            return str(header["unsupported"])
        at += head_len
        parts = []
        for size in header["sizes"]:
            parts.append(data[at : at + size])
            at += size
        if at != len(data):
            return None
        return cls.from_cache_parts(header, parts, load_full)
    except Exception:  # a missing, stale or corrupt cache is only a miss
        return None


def load_cached_compact(
    path: str | os.PathLike[str],
    family: str | None,
    cls: type[TokenDecoder],
    build: Callable[[Any, Path, Callable[[], Any]], TokenDecoder | str],
    build_command: Sequence[str] | None = None,
) -> Any:
    """`cls` for the checkpoint's tokenizer when `build` made one that behaves exactly as the
    full tokenizer, else the full tokenizer; the verdict (and the compact tokenizer's arrays)
    cached on disk beside the model or under tidal's cache directory, by cls.CACHE_SUFFIX.

    `build_command`: on a miss, first run this command (the path and family appended) to build
    and cache it in a process of its own, then read the cache: this process then never holds
    the full tokenizer, whose freed heap it would keep (~40 MiB for Gemma 3's). A command that
    fails or caches nothing leaves the build to this process."""
    from tidal.loader.heap import release_free_heap

    source = Path(path)

    def load_full() -> Any:
        # Imported here: a cache hit imports neither `tokenizers` nor numpy.
        from tidal.loader.tokenizer import load_tokenizer

        return load_tokenizer(source, family)

    if not (source.is_file() or source.is_dir()):
        return load_full()  # load_tokenizer names the problem
    key = _source_key(source, family, cls.cache_format())
    candidates = cache_candidates(source, cls.CACHE_SUFFIX)

    def read() -> Any:
        """The cached tokenizer, the full one where the cache says so, or None on a miss."""
        for cache_path in candidates:
            cached = _read_cache(cache_path, key, load_full, cls)
            if isinstance(cached, TokenDecoder):
                return cached
            if isinstance(cached, str):
                return load_full()
        return None

    found = read()
    if found is None and build_command and _run_build(build_command, source, family):
        found = read()
    if found is not None:
        return found
    tok = load_full()
    result = build(tok, source, load_full)
    for cache_path in candidates:
        if _write_cache(cache_path, key, result):
            break
    if isinstance(result, str):
        log.info("keeping the full tokenizer in this process: %s", result)
        return tok
    del tok
    release_free_heap()  # the full tokenizer's maps were most of this process's heap growth
    return result


def _run_build(command: Sequence[str], source: Path, family: str | None) -> bool:
    """Run a build command for `source`; False (and why, logged) if it did not finish well."""
    import subprocess

    try:
        proc = subprocess.run(
            [*command, str(source), family or ""],
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("building the compact tokenizer in another process failed: %s", exc)
        return False
    if proc.returncode != 0:
        log.warning(
            "building the compact tokenizer in another process failed (exit %d): %s",
            proc.returncode,
            proc.stderr.strip()[-2000:],
        )
        return False
    return True
