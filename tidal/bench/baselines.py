"""The llama.cpp-family baselines (llama.cpp, ik_llama.cpp): where their build scripts put the
binaries, and the flags each runs with at its best on a CPU."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Variant:
    """One way to run a baseline's benches; `tidal bench kernels` runs each and keeps the better
    figure per measure."""

    label: str  # the record's and the report's name for it
    bench_args: tuple[str, ...] = ()  # added to llama-bench
    batched_args: tuple[str, ...] = ()  # added to llama-batched-bench (common's arguments)


@dataclass(frozen=True, slots=True)
class Baseline:
    """A llama.cpp-family engine built by one of scripts/build_*.sh into tidal's cache."""

    name: str  # --baselines, --targets and the reports' column
    build_script: str
    bin_dir_flag: str  # `tidal bench kernels`' option naming another bin/
    stamp_file: str  # in bin/: what the binaries were built from (an sdist's name, a commit)
    server_env: str  # the environment variable naming another llama-server
    sigill_hint: str  # what a SIGILL means for its binaries
    # How it runs; the defaults are llama.cpp's.
    variants: tuple[Variant, ...] = (Variant("default"),)
    server_args: tuple[str, ...] = ()  # llama-server's flags beyond the ones all share
    # llama-batched-bench writes jsonl with `--output-format jsonl` (ik's prints its table only)
    batched_jsonl: bool = True
    # NOTE: both forks install binaries of the same names, so only llama.cpp may fall back to
    # one on PATH; ik_llama.cpp's must come from its own bin/.
    path_fallback: bool = True

    @property
    def key(self) -> str:
        """The kernels JSON record's key: "llama_cpp", "ik_llama_cpp"."""
        return self.name.replace(".", "_")

    def bin_dir(self, explicit: str | None = None) -> Path:
        """`explicit` (--llama-bin-dir, --ik-bin-dir), else the directory of the llama-server
        that server_env names, else where build_script installs (tidal's cache)."""
        if explicit:
            return Path(explicit)
        return self.server_path().parent

    def server_path(self) -> Path:
        """Where build_script puts llama-server (server_env overrides)."""
        if os.environ.get(self.server_env):
            return Path(os.environ[self.server_env])
        cache = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tidal"
        )
        return Path(cache) / self.name / "bin" / "llama-server"

    def find_server(self) -> str | None:
        """The built llama-server, else (llama.cpp only) one on PATH, else None."""
        path = self.server_path()
        if path.exists():
            return str(path)
        return shutil.which("llama-server") if self.path_fallback else None

    def find(self, bin_dir: Path, name: str) -> str | None:
        """The binary `name` in bin_dir, else (llama.cpp only) on PATH, else None."""
        path = bin_dir / name
        if path.exists():
            return str(path)
        return shutil.which(name) if self.path_fallback else None

    def stamp(self, bin_dir: Path) -> str | None:
        """What build_script wrote into bin_dir's stamp file (None: no stamp)."""
        return _read_line(bin_dir / self.stamp_file)

    def built(self, bin_dir: Path) -> str | None:
        """How and from what the binaries in bin_dir were built, e.g. "native from 8337e4c...";
        None where build_script wrote neither FLAVOR nor a stamp there."""
        flavor, stamp = build_flavor(bin_dir), self.stamp(bin_dir)
        parts = [part for part in (flavor, stamp and f"from {stamp}") if part]
        return " ".join(parts) or None


def build_flavor(bin_dir: Path) -> str | None:
    """How a build script built the binaries in bin_dir (its bin/FLAVOR: "native", or native
    without AMX on a CPU with AMX tiles), or None where it did not write one."""
    return _read_line(bin_dir / "FLAVOR")


def _read_line(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


_LLAMA_SIGILL = (
    "an illegal instruction: llama.cpp built natively dies so in its AMX matmul on Xeons with AMX"
    " tiles; rebuild with scripts/build_llama_server.sh, which leaves AMX out on such CPUs"
)
LLAMA_CPP = Baseline(
    "llama.cpp", build_script="scripts/build_llama_server.sh", bin_dir_flag="--llama-bin-dir",
    stamp_file="SDIST", server_env="LLAMA_SERVER", sigill_hint=_LLAMA_SIGILL)  # fmt: skip

# ik_llama.cpp's speed flags on a CPU (scripts/build_ik_llama.sh lists them): flash attention
# (-fa) and MLA 3 (-mla, DeepSeek models) are its defaults already; run-time repacking (-rtr:
# weights into the iqk kernels' interleaved _R4/_R8 rows at load, mmap off) is not, and is not
# faster for every type and shape, so the benches run both ways. The server takes -rtr as a flag,
# and ik's llama-batched-bench prints its table only.
_IK_SIGILL = (
    "an illegal instruction: ik_llama.cpp is built for the CPU it was built on (-march=native);"
    " rebuild it here with scripts/build_ik_llama.sh"
)
IK_LLAMA_CPP = Baseline(
    "ik_llama.cpp", build_script="scripts/build_ik_llama.sh", bin_dir_flag="--ik-bin-dir",
    stamp_file="COMMIT", server_env="IK_LLAMA_SERVER", sigill_hint=_IK_SIGILL,
    variants=(Variant("default"), Variant("-rtr 1", ("-rtr", "1"), ("-rtr",))),
    server_args=("-rtr",), batched_jsonl=False, path_fallback=False)  # fmt: skip

BASELINES: dict[str, Baseline] = {b.name: b for b in (LLAMA_CPP, IK_LLAMA_CPP)}
