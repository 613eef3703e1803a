"""WeightCache: a GGUF's loaded tensors saved beside it as safetensors, so later loads skip dequantizing."""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Bump when dequantization or name mapping changes what a load produces: every cache written by
# an older loader is then stale and rewritten on its next load.
LOADER_VERSION = "1"
_SUFFIX = ".tidal-weights.safetensors"
_STAMP_SUFFIX = ".stamp.json"  # tidal.loader.bundled writes it beside the bundled model
_FILE_MODE = 0o644
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.partial$")


@dataclass(frozen=True, slots=True)
class WeightCacheKey:
    """What a cache file must have been made from; stored in its safetensors metadata."""

    gguf_size_bytes: int
    gguf_mtime_ns: int
    gguf_inode: int
    # The sha256 recorded in the GGUF's stamp file ("" without one): a re-assembled bundled model
    # changes it even if size and mtime came out the same.
    gguf_sha256: str
    dtype: str
    loader_version: str
    torch_version: str

    def as_metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}


def weight_cache_path(gguf_path: Path, dtype: torch.dtype) -> Path:
    """Where the cache of `gguf_path` in `dtype` lives: beside it, one file per dtype."""
    dtype_name = str(dtype).removeprefix("torch.")
    return gguf_path.with_name(f"{gguf_path.name}.{dtype_name}{_SUFFIX}")


def weight_cache_key(gguf_path: Path, dtype: torch.dtype) -> WeightCacheKey:
    st = gguf_path.stat()
    return WeightCacheKey(
        gguf_size_bytes=st.st_size,
        gguf_mtime_ns=st.st_mtime_ns,
        gguf_inode=st.st_ino,
        gguf_sha256=_stamped_sha256(gguf_path),
        dtype=str(dtype).removeprefix("torch."),
        loader_version=LOADER_VERSION,
        torch_version=torch.__version__,
    )


def load_weight_cache(
    gguf_path: Path, dtype: torch.dtype, key: WeightCacheKey
) -> dict[str, torch.Tensor] | None:
    """The cached tensors (memory-mapped, copy-on-write) if a cache made from `key` exists, else None."""
    from safetensors import safe_open

    path = weight_cache_path(gguf_path, dtype)
    if not path.exists():
        return None
    try:
        with safe_open(path, framework="pt") as f:
            if f.metadata() != key.as_metadata():
                log.info("weight cache %s is stale (the GGUF or the loader changed)", path.name)
                return None
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # a truncated or foreign file: fall back to the GGUF, never fail
        log.warning("weight cache %s is unreadable (%s); loading the GGUF", path, e)
        return None


def save_weight_cache(
    gguf_path: Path, dtype: torch.dtype, key: WeightCacheKey, state: dict[str, torch.Tensor]
) -> Path | None:
    """Write `state` atomically (temp file + rename) beside the GGUF; None if it could not be.

    A failure (read-only directory, full disk) only costs the next start its speed, so it is
    logged and swallowed; the temp file never survives it.
    """
    from safetensors.torch import save_file

    path = weight_cache_path(gguf_path, dtype)
    _remove_dead_partials(path)
    tmp_name = ""
    try:
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{path.name}.{os.getpid()}.", suffix=".partial", dir=path.parent
        )
        os.close(fd)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
        save_file(tensors, tmp_name, metadata=key.as_metadata())
        os.chmod(tmp_name, _FILE_MODE)
        os.replace(tmp_name, path)
    except Exception as e:
        log.warning("could not write the weight cache %s: %s", path, e)
        return None
    finally:
        if tmp_name:
            Path(tmp_name).unlink(missing_ok=True)
    log.info("wrote the weight cache %s (%.0f MB)", path.name, path.stat().st_size / 1e6)
    return path


def _stamped_sha256(gguf_path: Path) -> str:
    import json

    try:
        stamp = json.loads(gguf_path.with_name(gguf_path.name + _STAMP_SUFFIX).read_text())
    except (OSError, ValueError):
        return ""
    sha = stamp.get("sha256") if isinstance(stamp, dict) else None
    return sha if isinstance(sha, str) else ""


def _remove_dead_partials(path: Path) -> None:
    """Delete temp files a killed writer left behind (their pid is gone): each is up to ~1 GB."""
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = _PARTIAL.match(entry.name)
        if m is None or m.group("name") != path.name or _alive(int(m.group("pid"))):
            continue
        entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
