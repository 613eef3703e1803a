#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-batched-bench once (from the llama-cpp-python
# sdist on PyPI) for `tidal bench compare` and `tidal bench kernels`; scripts/build_ik_llama.sh
# builds ik_llama.cpp's beside them (llama_build_common.sh holds what the two share).
#
# Idempotent per binary: builds only the targets whose binary is missing (all of them again when
# the binaries already there came from another sdist, so every binary shares one set of libraries).
# Output, with libllama/libggml beside the binaries:
#   ${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}/llama.cpp/bin/{llama-server,llama-bench,llama-batched-bench}
# Usage: nohup nice -n 19 bash scripts/build_llama_server.sh [TARGET...] > /tmp/llama_build.log 2>&1 &
#   TARGET defaults to the three above. LLAMA_BUILD_JOBS (default 2) sets the parallel jobs;
#   LLAMA_SDIST=path/to/llama_cpp_python-X.tar.gz skips the download.
#
# The build is native (-march=native), but on a CPU with AMX tiles the tile instructions are left
# out (-mno-amx-*; AVX-512 with VNNI and BF16 stays): llama.cpp 0.3.36's AMX matmul, built
# natively, dies with SIGILL (a tilezero in a worker thread) on such Xeons. bin/FLAVOR says which
# build the binaries are, and binaries of another flavor are rebuilt (those from before FLAVOR
# existed are native builds: kept on a CPU without AMX tiles, rebuilt on one with them).
set -euo pipefail

# shellcheck source=scripts/llama_build_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/llama_build_common.sh"

dest="$(llama_cache_dir)/llama.cpp"
bin_dir="$dest/bin"
stamp="$bin_dir/SDIST"  # the sdist file name the binaries in bin_dir were built from
if cpu_has_flag amx_tile; then
    flavor="native without AMX (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16: llama.cpp's AMX matmul dies with SIGILL on this CPU)"
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    extra_flags=(-DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx")
else
    flavor="native"
    extra_flags=()
fi
pip_bin="${PIP:-pip}"

prepare_build "$dest" "$flavor" "$@"
if [[ -n "${LLAMA_SDIST:-}" ]]; then
    cp "$LLAMA_SDIST" "$work/"
else
    echo "downloading the llama-cpp-python sdist into $work"
    # NOTE: --no-binary for this one package only: with :all: pip also builds every build
    # dependency (scikit-build-core, its own build backends, ...) from source, recursively.
    "$pip_bin" download --no-binary llama-cpp-python --no-deps llama-cpp-python -d "$work"
fi
sdist="$(ls "$work"/llama_cpp_python-*.tar.gz | head -n 1)"
sdist_name="$(basename "$sdist")"
add_other_source "$bin_dir" "$stamp" "$sdist_name"
tar -xzf "$sdist" -C "$work"
src="$(ls -d "$work"/llama_cpp_python-*/ | head -n 1)vendor/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    echo "no vendor/llama.cpp in $sdist" >&2
    exit 1
fi

# llama-bench and llama-batched-bench live under tools/ (LLAMA_BUILD_TOOLS). No prebuilt web UI:
# the download would only time out on an offline machine.
build_missing "$src" "$work" "$bin_dir" "$stamp" "$sdist_name" "$flavor" \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    ${extra_flags[@]+"${extra_flags[@]}"}
