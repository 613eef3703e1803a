# The steps that scripts/build_llama_server.sh (llama.cpp) and scripts/build_ik_llama.sh
# (ik_llama.cpp) share; sourced by them, not run.
#
# Both keep, beside the binaries in their bin/, a FLAVOR file (how they were built) and a stamp
# (what they were built from: an sdist's file name, a commit). Binaries of another flavor, or with
# another stamp, are rebuilt: every binary in one bin/ must share one set of shared libraries.

# tidal's cache directory (TIDAL_CACHE_DIR, else XDG_CACHE_HOME/tidal, else ~/.cache/tidal)
llama_cache_dir() {
    echo "${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}"
}

# cpu_has_flag FLAG: whether /proc/cpuinfo (LLAMA_CPUINFO: another file, the tests' fake CPUs)
# lists FLAG
cpu_has_flag() {
    local flags
    flags="$(grep -m1 '^flags' "${LLAMA_CPUINFO:-/proc/cpuinfo}" 2>/dev/null || true)"
    [[ " $flags " == *" $1 "* ]]
}

# prepare_build DEST FLAVOR [TARGET...]: sets `missing` to the TARGETs (default: llama-bench,
# llama-batched-bench, llama-server) whose binary DEST/bin lacks, and ends the script when none is
# missing; else makes DEST/bin and sets `work` to a new build directory in DEST.
prepare_build() {
    local dest="$1" flavor="$2"
    shift 2
    local targets=("$@")
    # NOTE: the benchmark tools first: they are what `tidal bench kernels` needs, and the
    # server's build is the longest.
    if [[ ${#targets[@]} -eq 0 ]]; then
        targets=(llama-bench llama-batched-bench llama-server)
    fi
    select_missing "$dest/bin" "$flavor" "${targets[@]}"
    if [[ ${#missing[@]} -eq 0 ]]; then
        exit 0
    fi
    mkdir -p "$dest/bin"
    work="$(mktemp -d "$dest/build.XXXXXX")"
}

# select_missing BIN_DIR FLAVOR TARGET...: sets the array `missing` to the targets to build.
# Binaries of another flavor are removed first (all of them); those from before FLAVOR was
# written were native builds, so they are kept where "native" is this CPU's flavor.
select_missing() {
    local bin_dir="$1" flavor="$2" binary target
    shift 2
    local flavor_file="$bin_dir/FLAVOR"
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
    missing=()
    for target in "$@"; do
        if [[ -x "$bin_dir/$target" ]]; then
            echo "$target already built: $bin_dir/$target"
        else
            missing+=("$target")
        fi
    done
}

# add_other_source BIN_DIR STAMP_FILE STAMP: the binaries in BIN_DIR not built from STAMP (or
# with no stamp) join `missing`: the shared libraries are copied over the old ones, so they would
# load libraries they were not linked against.
add_other_source() {
    local bin_dir="$1" stamp_file="$2" stamp="$3" binary name
    if [[ "$(cat "$stamp_file" 2>/dev/null)" == "$stamp" ]]; then
        return 0
    fi
    for binary in "$bin_dir"/llama-*; do
        [[ -x "$binary" ]] || continue
        name="$(basename "$binary")"
        [[ " ${missing[*]} " == *" $name "* ]] || missing+=("$name")
    done
    echo "building ${missing[*]} from $stamp (bin/ held $(cat "$stamp_file" 2>/dev/null || echo 'no stamp'))"
}

# build_missing SRC WORK BIN_DIR STAMP_FILE STAMP FLAVOR [CMAKE_ARG...]: configures SRC in
# WORK/build, builds each of `missing` (LLAMA_BUILD_JOBS jobs, default 2) and installs it with
# the shared libraries beside it, then writes the stamp and FLAVOR. Removes WORK when all built;
# keeps it (so a rerun's log can be compared) and fails otherwise.
build_missing() {
    local src="$1" work="$2" bin_dir="$3" stamp_file="$4" stamp="$5" flavor="$6" target
    shift 6
    local jobs="${LLAMA_BUILD_JOBS:-2}" failed=()
    # No curl, tests or prebuilt web UI: downloads would only time out on an offline machine.
    # RUNPATH $ORIGIN: the binaries find libllama/libggml beside them once the build tree is gone.
    cmake -S "$src" -B "$work/build" \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "$@"
    for target in "${missing[@]}"; do
        echo "building $target"
        if ! cmake --build "$work/build" --target "$target" -j "$jobs"; then
            echo "failed to build $target" >&2
            failed+=("$target")
            continue
        fi
        cp "$work/build/bin/$target" "$bin_dir/$target.tmp"
        find "$work/build" -name '*.so*' -exec cp -P {} "$bin_dir/" \; 2>/dev/null || true
        mv "$bin_dir/$target.tmp" "$bin_dir/$target"
        echo "$stamp" > "$stamp_file"
        echo "$flavor" > "$bin_dir/FLAVOR"
        echo "built $bin_dir/$target"
    done
    if [[ ${#failed[@]} -gt 0 ]]; then
        echo "not built: ${failed[*]} (build tree kept in $work)" >&2
        return 1
    fi
    rm -rf "$work"
}
