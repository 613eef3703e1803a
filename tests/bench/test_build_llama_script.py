"""scripts/build_llama_server.sh with a stand-in cmake: native builds, AMX left out on a CPU with
AMX tiles (llama.cpp 0.3.36's AMX matmul dies with SIGILL there), and binaries of another build
flavor rebuilt."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_llama_server.sh"

# the stand-in: logs every call; `cmake --build B --target T` makes B/bin/T and a library
CMAKE = """#!/bin/sh
echo "$*" >> "$CMAKE_LOG"
if [ "$1" = "--build" ]; then
    mkdir -p "$2/bin"
    printf '#!/bin/sh\\necho built\\n' > "$2/bin/$4"
    chmod +x "$2/bin/$4"
    touch "$2/bin/libggml.so"
fi
"""


def _setup(tmp_path: Path, flags: str) -> tuple[dict[str, str], Path]:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "cmake").write_text(CMAKE)
    (tools / "cmake").chmod(0o755)
    src = tmp_path / "src" / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(x)\n")
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tmp_path / "src" / "llama_cpp_python-9.9.9", arcname="llama_cpp_python-9.9.9")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    env = dict(
        os.environ,
        PATH=f"{tools}:{os.environ['PATH']}",
        TIDAL_CACHE_DIR=str(tmp_path / "cache"),
        LLAMA_SDIST=str(sdist),
        LLAMA_CPUINFO=str(cpuinfo),
        CMAKE_LOG=str(tmp_path / "cmake.log"),
    )
    return env, tmp_path / "cache" / "llama.cpp" / "bin"


def _run(env: dict[str, str], *targets: str) -> str:
    proc = subprocess.run(["bash", str(SCRIPT), *targets], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_amx_cpu_builds_without_amx_and_rebuilds_other_flavors(tmp_path: Path) -> None:
    env, bin_dir = _setup(tmp_path, "fpu sse avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8")
    # binaries from before FLAVOR existed (a native build that dies here)
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-bench").write_text("#!/bin/sh\n")
    (bin_dir / "llama-bench").chmod(0o755)
    out = _run(env, "llama-bench", "llama-batched-bench")
    assert "rebuilding llama-bench: built as 'unknown'" in out
    log = (tmp_path / "cmake.log").read_text().splitlines()
    configure = log[0]
    assert "-DGGML_NATIVE=ON" in configure
    assert "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in configure
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in configure
    assert [line.split()[3] for line in log[1:]] == ["llama-bench", "llama-batched-bench"]
    assert (bin_dir / "FLAVOR").read_text().startswith("native without AMX (-mno-amx-tile")
    assert (bin_dir / "SDIST").read_text().strip() == "llama_cpp_python-9.9.9.tar.gz"
    # the same flavor again: nothing to do
    assert "llama-bench already built" in _run(env, "llama-bench")
    assert len((tmp_path / "cmake.log").read_text().splitlines()) == 3


def test_cpu_without_amx_builds_natively(tmp_path: Path) -> None:
    env, bin_dir = _setup(tmp_path, "fpu sse avx2 fma f16c")
    _run(env, "llama-bench")
    configure = (tmp_path / "cmake.log").read_text().splitlines()[0]
    assert "-DGGML_NATIVE=ON" in configure and "CMAKE_C_FLAGS" not in configure
    assert (bin_dir / "FLAVOR").read_text().strip() == "native"
    assert (bin_dir / "llama-bench").exists()


def test_binaries_from_before_flavor_are_kept_where_native_is_this_cpus_build(
    tmp_path: Path,
) -> None:
    env, bin_dir = _setup(tmp_path, "fpu sse avx2 fma f16c")
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-bench").write_text("#!/bin/sh\n")
    (bin_dir / "llama-bench").chmod(0o755)
    assert "llama-bench already built" in _run(env, "llama-bench")
    assert not (tmp_path / "cmake.log").exists()  # nothing rebuilt
    assert (bin_dir / "FLAVOR").read_text().strip() == "native"
