#!/usr/bin/env bash
# Build ik_llama.cpp's (ikawrakow/ik_llama.cpp, the CPU-focused llama.cpp fork) llama-bench,
# llama-batched-bench and llama-server once, for the ik_llama.cpp baseline of `tidal bench kernels`
# and `tidal bench compare`; scripts/build_llama_server.sh builds llama.cpp's beside it.
#
# Idempotent per binary, like build_llama_server.sh (llama_build_common.sh holds what they share).
# Output, with its libllama/libggml beside the binaries and bin/COMMIT naming the commit built:
#   ${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}/ik_llama.cpp/bin/{llama-bench,llama-batched-bench,llama-server}
# Usage: nohup nice -n 19 bash scripts/build_ik_llama.sh [TARGET...] > /tmp/ik_llama_build.log 2>&1 &
#   TARGET defaults to the three above; LLAMA_BUILD_JOBS (default 2) sets the parallel jobs.
#   The source, first that is set:
#   IK_LLAMA_SRC=/path/to/ik_llama.cpp  a source tree (its commit: IK_LLAMA_COMMIT, else the
#                                       HEAD of its .git, else "unknown")
#   IK_LLAMA_GIT=url-or-path            a repository to clone (bare, one commit), default
#                                       https://github.com/ikawrakow/ik_llama.cpp; IK_LLAMA_REF
#                                       picks a branch or tag. Files whose blobs the repository
#                                       lacks (a partial snapshot) are left out of the tree.
#
# The build is native (-march=native) with AMX left in: unlike llama.cpp (whose AMX matmul dies
# with SIGILL on the Xeons build_llama_server.sh works around), ik_llama.cpp has no AMX code (its
# CPU matmuls are the iqk AVX2/AVX-512 kernels, GGML_IQK_MUL_MAT, on by default) and the compiler
# emits no tile instructions by itself.
#
# ik_llama.cpp's flags for CPU speed (tidal's bench targets pass them):
#   -rtr 1 (--run-time-repack)  repack the weights at load into interleaved rows (_R4/_R8 types),
#                               the iqk kernels' fast layout; llama-bench, llama-server alike
#   -fa 1 (--flash-attn)        the iqk flash-attention CPU kernels
#   -mla 3                      DeepSeek V2/V3 MLA attention computed for CPUs (MLA models only)
set -euo pipefail

# shellcheck source=scripts/llama_build_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/llama_build_common.sh"

dest="$(llama_cache_dir)/ik_llama.cpp"
bin_dir="$dest/bin"
stamp_file="$bin_dir/COMMIT"  # the commit the binaries in bin_dir were built from
flavor="native"

prepare_build "$dest" "$flavor" "$@"
if [[ -n "${IK_LLAMA_SRC:-}" ]]; then
    src="$IK_LLAMA_SRC"
    if [[ -z "${IK_LLAMA_COMMIT:-}" && -e "$src/.git" ]]; then
        IK_LLAMA_COMMIT="$(git -C "$src" rev-parse HEAD)"
    fi
    commit="${IK_LLAMA_COMMIT:-unknown (source tree $src)}"
else
    repo="${IK_LLAMA_GIT:-https://github.com/ikawrakow/ik_llama.cpp}"
    echo "cloning $repo into $work/git"
    # NOTE: --depth is ignored for a local path (git warns), which is then hard-linked: cheap.
    git clone --quiet --bare --depth 1 ${IK_LLAMA_REF:+--branch "$IK_LLAMA_REF"} "$repo" "$work/git"
    commit="$(git --git-dir="$work/git" rev-parse HEAD)"
    # Blobs absent from the repository (a snapshot without its large files) would stop `git
    # archive`: leave their paths out.
    absent_blobs=" $(git --git-dir="$work/git" ls-tree -r "$commit" | awk '$2 == "blob" {print $3}' \
        | git --git-dir="$work/git" cat-file --batch-check | awk '$2 == "missing" {printf "%s ", $1}')"
    excludes=()
    while IFS=$'\t' read -r meta path; do
        if [[ "$absent_blobs" == *" ${meta##* } "* ]]; then
            echo "left out (not in the repository): $path"
            excludes+=(":(exclude,literal)$path")
        fi
    done < <(git --git-dir="$work/git" ls-tree -r "$commit")
    src="$work/src"
    mkdir -p "$src"
    # NOTE: git archive still reports each left-out blob as an invalid object (and succeeds).
    git --git-dir="$work/git" archive "$commit" -- . ${excludes[@]+"${excludes[@]}"} 2> /dev/null \
        | tar -x -C "$src"
fi
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    echo "no CMakeLists.txt in $src: not an ik_llama.cpp source tree" >&2
    exit 1
fi
echo "ik_llama.cpp commit: $commit"
add_other_source "$bin_dir" "$stamp_file" "$commit"

# ik_llama.cpp keeps llama-bench, llama-batched-bench and llama-server under examples/.
build_missing "$src" "$work" "$bin_dir" "$stamp_file" "$commit" "$flavor" -DLLAMA_BUILD_EXAMPLES=ON
