#!/usr/bin/env bash
# Build llama.cpp's llama-server once (from the llama-cpp-python sdist on PyPI) for `tidal bench compare`.
#
# Idempotent: exits at once when the binary already exists. Output:
#   ${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}/llama.cpp/bin/llama-server
# Usage: nohup nice -n 19 bash scripts/build_llama_server.sh > /tmp/llama_build.log 2>&1 &
set -euo pipefail

cache_dir="${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}"
dest="$cache_dir/llama.cpp"
binary="$dest/bin/llama-server"
jobs="${LLAMA_BUILD_JOBS:-2}"
pip_bin="${PIP:-pip}"

if [[ -x "$binary" ]]; then
    echo "llama-server already built: $binary"
    exit 0
fi

mkdir -p "$dest"
work="$(mktemp -d "$dest/build.XXXXXX")"
# NOTE: keep the build tree on failure so a rerun's log can be compared; remove it on success.
echo "downloading the llama-cpp-python sdist into $work"
# NOTE: --no-binary for this one package only: with :all: pip also builds every build
# dependency (scikit-build-core, its own build backends, ...) from source, recursively.
"$pip_bin" download --no-binary llama-cpp-python --no-deps llama-cpp-python -d "$work"
sdist="$(ls "$work"/llama_cpp_python-*.tar.gz | head -n 1)"
tar -xzf "$sdist" -C "$work"
src="$(ls -d "$work"/llama_cpp_python-*/ | head -n 1)vendor/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    echo "no vendor/llama.cpp in $sdist" >&2
    exit 1
fi

cmake -S "$src" -B "$work/build" \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
cmake --build "$work/build" --target llama-server -j "$jobs"

mkdir -p "$dest/bin"
built="$work/build/bin/llama-server"
# Shared-library builds put libllama/libggml next to the binary; copy them too (the binary's
# RUNPATH is $ORIGIN, so it finds them there once the build tree is gone).
cp "$built" "$dest/bin/llama-server.tmp"
find "$work/build" -name '*.so*' -exec cp -P {} "$dest/bin/" \; 2>/dev/null || true
mv "$dest/bin/llama-server.tmp" "$binary"
rm -rf "$work"
echo "built $binary"
