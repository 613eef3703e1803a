"""In-process A/B of two builds of the GGUF block kernels on Gemma 3 270M's matrix shapes.

    python scripts/ab_gguf_gemm.py [--base HEAD~1] [--act q8|f32] [--rows 1,2,8,32,128] [--reps 7]

Builds tidal/kernels/gguf_gemm.c as it is in the working tree and as it was at --base (git),
with build.py's flags, loads both into this process and times tidal_gguf_gemm alternating on the
same random blocks and activations: the Q8_0 LM head (up to 32 rows), the fused q/k/v and
gate/up projections (Q5_0) and the down projections (Q4_K, Q6_K). Each row of the table says
whether the two builds gave the same bits. Separate processes on a shared host swing far more
than the differences measured here; one process, alternating calls, best of --reps, does not.
"""

from __future__ import annotations

import argparse
import ctypes
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="HEAD~1", help="git revision to compare the working tree with")
    p.add_argument("--act", choices=gg.ACTS, default="q8")
    p.add_argument("--rows", default="1,2,8,32,128", help="batch sizes (rows of x)")
    p.add_argument("--isa", default=None, help="kernel path (default: this machine's best)")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    if not gg.available():
        sys.exit("no C compiler: nothing to compare")
    act, isa = gg._ACT_CODES[args.act], gg._isa_code(args.isa)
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = build(source_at(args.base, Path(tmp) / "base.c"), Path(tmp) / "base.so")
        new = build(ROOT / "tidal" / "kernels" / "gguf_gemm.c", Path(tmp) / "new.so")
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
