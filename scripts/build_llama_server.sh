#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-batched-bench once (from the llama-cpp-python
# sdist on PyPI) for `tidal bench compare` and `tidal bench kernels`.
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

cache_dir="${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}"
dest="$cache_dir/llama.cpp"
bin_dir="$dest/bin"
stamp="$bin_dir/SDIST"  # the sdist file name the binaries in bin_dir were built from
flavor_file="$bin_dir/FLAVOR"  # how they were built (below)
# LLAMA_CPUINFO: another cpuinfo to read the flags from (the tests' fake CPUs)
cpu_flags="$(grep -m1 '^flags' "${LLAMA_CPUINFO:-/proc/cpuinfo}" 2>/dev/null || true)"
if [[ " $cpu_flags " == *" amx_tile "* ]]; then
    flavor="native without AMX (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16: llama.cpp's AMX matmul dies with SIGILL on this CPU)"
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    extra_flags=(-DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx")
else
    flavor="native"
    extra_flags=()
fi
jobs="${LLAMA_BUILD_JOBS:-2}"
pip_bin="${PIP:-pip}"
# NOTE: the benchmark tools first: they are what `tidal bench kernels` needs, and the server's
# build is the longest.
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(llama-bench llama-batched-bench llama-server)
fi

missing=()
# Binaries from before FLAVOR was written were built natively: kept where that is this CPU's
# flavor. Binaries of another flavor are rebuilt, all of them.
if [[ ! -e "$flavor_file" && "$flavor" == "native" ]] && compgen -G "$bin_dir/llama-*" > /dev/null; then
    echo "$flavor" > "$flavor_file"
fi
if [[ "$(cat "$flavor_file" 2>/dev/null)" != "$flavor" ]]; then
    for binary in "$bin_dir"/llama-*; do
        [[ -x "$binary" ]] || continue
        echo "rebuilding $(basename "$binary"): built as '$(cat "$flavor_file" 2>/dev/null || echo 'unknown')', this CPU takes '$flavor'"
        rm -f "$binary"
    done
fi
for target in "${targets[@]}"; do
    if [[ -x "$bin_dir/$target" ]]; then
        echo "$target already built: $bin_dir/$target"
    else
        missing+=("$target")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

mkdir -p "$bin_dir"
work="$(mktemp -d "$dest/build.XXXXXX")"
# NOTE: keep the build tree on failure so a rerun's log can be compared; remove it on success.
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
# The shared libraries are copied over the old ones, so binaries from another (or an unknown:
# no stamp) sdist would load libraries they were not linked against: rebuild those too.
if [[ "$(cat "$stamp" 2>/dev/null)" != "$sdist_name" ]]; then
    for binary in "$bin_dir"/llama-*; do
        [[ -x "$binary" ]] || continue
        name="$(basename "$binary")"
        [[ " ${missing[*]} " == *" $name "* ]] || missing+=("$name")
    done
    echo "building ${missing[*]} from $sdist_name (bin/ held $(cat "$stamp" 2>/dev/null || echo 'no stamp'))"
fi
tar -xzf "$sdist" -C "$work"
src="$(ls -d "$work"/llama_cpp_python-*/ | head -n 1)vendor/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    echo "no vendor/llama.cpp in $sdist" >&2
    exit 1
fi

# llama-bench and llama-batched-bench live under tools/ (LLAMA_BUILD_TOOLS); the server also needs
# LLAMA_BUILD_SERVER. No prebuilt web UI: the download would only time out on an offline machine.
cmake -S "$src" -B "$work/build" \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON ${extra_flags[@]+"${extra_flags[@]}"}

failed=()
for target in "${missing[@]}"; do
    echo "building $target"
    if ! cmake --build "$work/build" --target "$target" -j "$jobs"; then
        echo "failed to build $target" >&2
        failed+=("$target")
        continue
    fi
    # Shared-library builds put libllama/libggml next to the binary; copy them too (the binary's
    # RUNPATH is $ORIGIN, so it finds them there once the build tree is gone).
    cp "$work/build/bin/$target" "$bin_dir/$target.tmp"
    find "$work/build" -name '*.so*' -exec cp -P {} "$bin_dir/" \; 2>/dev/null || true
    mv "$bin_dir/$target.tmp" "$bin_dir/$target"
    echo "$sdist_name" > "$stamp"
    echo "$flavor" > "$flavor_file"
    echo "built $bin_dir/$target"
done

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "not built: ${failed[*]} (build tree kept in $work)" >&2
    exit 1
fi
rm -rf "$work"
