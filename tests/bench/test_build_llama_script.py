"""scripts/build_llama_server.sh and scripts/build_ik_llama.sh with a stand-in cmake: native builds,
AMX left out of llama.cpp's on a CPU with AMX tiles (llama.cpp 0.3.36's AMX matmul dies with SIGILL
there) but not out of ik_llama.cpp's, binaries of another build flavor or source rebuilt."""

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


# scripts/build_ik_llama.sh: the same stand-in cmake, ik_llama.cpp's sources from a tree or a repo

IK_SCRIPT = SCRIPT.with_name("build_ik_llama.sh")
AMX_FLAGS = "fpu sse avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8"


def _git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return proc.stdout.strip()


def _ik_repo(tmp_path: Path) -> tuple[Path, str]:
    """A repository of an ik_llama.cpp-shaped tree: (its path, its HEAD commit)."""
    repo = tmp_path / "ik_llama.cpp"
    (repo / "examples").mkdir(parents=True)
    (repo / "CMakeLists.txt").write_text("project(ik)\n")
    (repo / "examples" / "big.gguf").write_text("large file\n")
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "snapshot")
    return repo, _git(repo, "rev-parse", "HEAD")


def _ik_env(tmp_path: Path, flags: str, **source: str) -> tuple[dict[str, str], Path]:
    env, _ = _setup(tmp_path, flags)
    del env["LLAMA_SDIST"]
    # the stand-in's configure step also lists the source tree it was given
    listing = '[ "$1" = "-S" ] && ls -R "$2" > "$CMAKE_LOG.src"\n'
    (tmp_path / "tools" / "cmake").write_text(
        CMAKE.replace('"$CMAKE_LOG"\n', f'"$CMAKE_LOG"\n{listing}', 1)
    )
    return {**env, **source}, tmp_path / "cache" / "ik_llama.cpp" / "bin"


def _run_ik(env: dict[str, str], *targets: str) -> str:
    proc = subprocess.run(["bash", str(IK_SCRIPT), *targets], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_ik_builds_natively_with_amx_from_a_source_tree_and_stamps_its_commit(
    tmp_path: Path,
) -> None:
    """ik_llama.cpp has no AMX code: its build keeps -march=native whole on a CPU with tiles."""
    repo, commit = _ik_repo(tmp_path)
    env, bin_dir = _ik_env(tmp_path, AMX_FLAGS, IK_LLAMA_SRC=str(repo))
    _run_ik(env)
    log = (tmp_path / "cmake.log").read_text().splitlines()
    configure = log[0]
    assert f"-S {repo} " in configure and "-DGGML_NATIVE=ON" in configure
    assert "-DLLAMA_BUILD_EXAMPLES=ON" in configure and "-DLLAMA_BUILD_SERVER=ON" in configure
    assert "amx" not in configure and "CMAKE_C_FLAGS" not in configure
    targets = [line.split()[3] for line in log[1:]]
    assert targets == ["llama-bench", "llama-batched-bench", "llama-server"]
    assert all((bin_dir / t).exists() for t in targets) and (bin_dir / "libggml.so").exists()
    assert (bin_dir / "COMMIT").read_text().strip() == commit
    assert (bin_dir / "FLAVOR").read_text().strip() == "native"
    assert not list(bin_dir.parent.glob("build.*"))  # the build tree is gone
    assert "llama-bench already built" in _run_ik(env, "llama-bench")
    assert len((tmp_path / "cmake.log").read_text().splitlines()) == 4
    assert "CMakeLists.txt" in (tmp_path / "cmake.log.src").read_text()  # built from the tree


def test_ik_clones_a_repository_without_the_blobs_it_lacks(tmp_path: Path) -> None:
    """A snapshot of the repository without some large files still builds: the files whose blobs
    are missing are left out of the tree."""
    repo, commit = _ik_repo(tmp_path)
    blob = _git(repo, "rev-parse", "HEAD:examples/big.gguf")
    (repo / ".git" / "objects" / blob[:2] / blob[2:]).unlink()  # the snapshot lacks it
    env, bin_dir = _ik_env(tmp_path, "fpu sse avx2 fma f16c", IK_LLAMA_GIT=str(repo))
    out = _run_ik(env, "llama-bench")
    assert "left out (not in the repository): examples/big.gguf" in out
    tree = (tmp_path / "cmake.log.src").read_text()
    assert "CMakeLists.txt" in tree and "big.gguf" not in tree
    assert (bin_dir / "COMMIT").read_text().strip() == commit
    assert (bin_dir / "llama-bench").exists() and not (bin_dir / "llama-server").exists()


def test_ik_binaries_of_another_commit_are_rebuilt_with_the_missing_one(tmp_path: Path) -> None:
    repo, commit = _ik_repo(tmp_path)
    env, bin_dir = _ik_env(tmp_path, AMX_FLAGS, IK_LLAMA_SRC=str(repo))
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-bench").write_text("#!/bin/sh\n")
    (bin_dir / "llama-bench").chmod(0o755)
    (bin_dir / "COMMIT").write_text("0123abc\n")
    (bin_dir / "FLAVOR").write_text("native\n")
    out = _run_ik(env, "llama-bench", "llama-server")
    assert f"building llama-server llama-bench from {commit} (bin/ held 0123abc)" in out
    log = (tmp_path / "cmake.log").read_text().splitlines()
    assert [line.split()[3] for line in log[1:]] == ["llama-server", "llama-bench"]
    assert (bin_dir / "COMMIT").read_text().strip() == commit


def test_ik_source_tree_outside_git_takes_its_commit_from_the_environment(tmp_path: Path) -> None:
    src = tmp_path / "export"
    src.mkdir()
    (src / "CMakeLists.txt").write_text("project(ik)\n")
    env, bin_dir = _ik_env(tmp_path, AMX_FLAGS, IK_LLAMA_SRC=str(src))
    _run_ik(env, "llama-bench")
    assert (bin_dir / "COMMIT").read_text().strip() == f"unknown (source tree {src})"
    (bin_dir / "llama-bench").unlink()
    _run_ik({**env, "IK_LLAMA_COMMIT": "8337e4cd"}, "llama-bench")
    assert (bin_dir / "COMMIT").read_text().strip() == "8337e4cd"
