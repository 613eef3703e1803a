"""In-process A/B of two builds of the GGUF block kernels on Gemma 3 270M's matrix shapes.

    python scripts/ab_gguf_gemm.py [--base HEAD~1] [--act q8|f32] [--rows 1,2,8,32,128] [--reps 7]
    python scripts/ab_gguf_gemm.py --stack [--base HEAD~1] [--rows 1] [--reps 21]

Builds tidal/kernels/gguf_gemm.c as it is in the working tree and as it was at --base (git),
with build.py's flags, loads both into this process and times tidal_gguf_gemm alternating on the
same random blocks and activations: the Q8_0 LM head (up to 32 rows), the fused q/k/v and
gate/up projections (Q5_0) and the down projections (Q4_K, Q6_K). Each row of the table says
whether the two builds gave the same bits. Separate processes on a shared host swing far more
than the differences measured here; one process, alternating calls, best of --reps, does not.

Each shape above is timed on its own, so its weights sit in the L3 cache after the first call.
`--stack` times a decode step's 72 layer matmuls instead (18 layers of qkv, o, gate/up and down,
each layer its own random blocks, ~69 MB: more than an L3 holds), one pass of all of them per
timing, so every matrix streams from memory as it does in the engine (prefetching shows here).
Same code on both sides (`--base HEAD`, clean tree) read 1.01x / 0.96x (best / median of 31) and
1.22x / 1.03x (of 11) on a shared 2-core host: take more --reps and trust differences above that.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tidal.kernels import gguf_gemm as gg  # noqa: E402
from tidal.kernels.bench_gguf import random_blocks  # noqa: E402
from tidal.kernels.build import _FLAGS  # noqa: E402

# (name, ggml type, rows N, cols K, largest batch timed)
# A decode step's layer matmuls for --stack: Gemma 3 270M's 18 layers (down alternates Q4_K/Q6_K)
STACK_LAYERS = 18
STACK_SHAPES = ((6, 1536, 640), (12, 640, 1024), (6, 4096, 640), (12, 640, 2048))
SHAPES = (
    ("lm_head Q8_0", 8, 262144, 640, 32),
    ("qkv Q5_0", 6, 1536, 640, 1024),
    ("gate/up Q5_0", 6, 4096, 640, 1024),
    ("down Q4_K", 12, 640, 2048, 1024),
    ("down Q6_K", 14, 640, 2048, 1024),
)


def build(src: Path, out: Path) -> ctypes.CDLL:
    cmd = ["gcc", *_FLAGS, f"-I{ROOT / 'tidal' / 'kernels'}", str(src), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.tidal_gguf_gemm.restype = ctypes.c_int
    return lib


def source_at(rev: str, dst: Path) -> Path:
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:tidal/kernels/gguf_gemm.c"],
                          check=True, capture_output=True).stdout  # fmt: skip
    dst.write_bytes(text)
    return dst


def call(lib: ctypes.CDLL, x: torch.Tensor, w: gg.BlockWeight, act: int, isa: int) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, w.rows)
    segs = (ctypes.c_int64 * 3)(w.blocks.data_ptr(), w.ggml_type, w.rows)
    args = (x.data_ptr(), m, k, k, segs, 1, y.data_ptr(), w.rows, act, isa, torch.get_num_threads())
    rc = lib.tidal_gguf_gemm(
        *(a if isinstance(a, ctypes.Array) else ctypes.c_void_p(a) for a in args)
    )
    if rc != 0:
        raise RuntimeError(f"tidal_gguf_gemm returned {rc}")
    return y


def time_stack(base: ctypes.CDLL, new: ctypes.CDLL, rows: int, reps: int, act: int, isa: int,
               label: str) -> None:  # fmt: skip
    """Best and median of --reps passes over the whole stack, the two builds alternating."""
    stack = [
        random_blocks(14 if layer % 2 and t == 12 and k == 2048 else t, n, k, seed=layer)
        for layer in range(STACK_LAYERS)
        for t, n, k in STACK_SHAPES
    ]
    xs = {k: torch.randn(rows, k) for _, _, k in STACK_SHAPES}
    same = all(torch.equal(call(base, xs[w.cols], w, act, isa), call(new, xs[w.cols], w, act, isa))
               for w in stack)  # fmt: skip
    times: list[list[float]] = [[], []]
    for _ in range(reps):
        for i, lib in enumerate((base, new)):
            t0 = time.perf_counter()
            for w in stack:
                call(lib, xs[w.cols], w, act, isa)
            times[i].append(time.perf_counter() - t0)
    (a, b), (ma, mb) = (min(t) for t in times), (statistics.median(t) for t in times)
    mb_total = sum(w.blocks.numel() for w in stack) / 1e6
    print(f"{len(stack)} matmuls, {rows} row(s), {mb_total:.0f} MB of weights from memory, "
          f"best / median of {reps} (ms): {label} {a * 1e3:.2f} / {ma * 1e3:.2f}, working tree "
          f"{b * 1e3:.2f} / {mb * 1e3:.2f}: {a / b:.2f}x / {ma / mb:.2f}x"
          f"{'' if same else ' (bits differ)'}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="HEAD~1", help="git revision to compare the working tree with")
    p.add_argument("--act", choices=gg.ACTS, default="q8")
    p.add_argument("--rows", default="1,2,8,32,128", help="batch sizes (rows of x)")
    p.add_argument("--isa", default=None, help="kernel path (default: this machine's best)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--stack", action="store_true",
                   help="time a decode step's 72 layer matmuls, weights from memory")  # fmt: skip
    args = p.parse_args()
    if not gg.available():
        sys.exit("no C compiler: nothing to compare")
    act, isa = gg._ACT_CODES[args.act], gg._isa_code(args.isa)
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = build(source_at(args.base, Path(tmp) / "base.c"), Path(tmp) / "base.so")
        new = build(ROOT / "tidal" / "kernels" / "gguf_gemm.c", Path(tmp) / "new.so")
        if args.stack:
            for m in rows:
                time_stack(base, new, m, args.reps, act, isa, args.base)
            return
        print(f"threads {torch.get_num_threads()}, act {args.act}, best of {args.reps} (ms)")
        print(f"| shape | rows | {args.base} | working tree | ratio |\n|---|---|---|---|---|")
        for name, ggml_type, n, k, most in SHAPES:
            w = random_blocks(ggml_type, n, k)
            for m in (r for r in rows if r <= most):
                x = torch.randn(m, k)
                same = torch.equal(call(base, x, w, act, isa), call(new, x, w, act, isa))
                best = [float("inf"), float("inf")]
                for _ in range(args.reps):
                    for i, lib in enumerate((base, new)):
                        t0 = time.perf_counter()
                        call(lib, x, w, act, isa)
                        best[i] = min(best[i], time.perf_counter() - t0)
                a, b = best
                flag = "" if same else " (bits differ)"
                print(f"| {name} | {m} | {a * 1e3:.3f} | {b * 1e3:.3f} | {a / b:.2f}x{flag} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
