"""GB/s of one decode step's matmuls streaming a 7B-class layer stack from memory, per type.

    python scripts/measure_decode_stream.py [--types Q4_K,Q6_K,Q8_0] [--isa amx] [--rows 1]
                                             [--layers 6] [--threads 2] [--huge-pages]

Each type gets its own stack of --layers layers of Qwen2.5-7B's two largest matrices (ffn_gate
18944 x 3584 and ffn_down 3584 x 18944; 0.46 GB of Q4_K to 0.87 GB of Q8_0 at 6 layers, more than
any L3 here), random valid blocks, each matrix its own memory. One pass calls gguf_gemm on every
matrix in turn with --rows rows of x, as a decode step does, so every byte comes from memory; the
figure is the stack's bytes over the pass's time, best and median of --reps passes after two
warm-ups. Compare it with what the machine reads (a plain two-thread read, e.g. `sysbench memory`
or the README's note) to see how far a kernel is from memory speed. --huge-pages copies each
matrix into transparent huge pages first, as the engine does with large matrices once it is ready.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tidal.kernels import gguf_gemm as gg  # noqa: E402
from tidal.kernels.bench_gguf import random_blocks  # noqa: E402
from tidal.loader.resident import resident_copy  # noqa: E402

TYPES = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
SHAPES = ((18944, 3584), (3584, 18944))  # (rows, cols): ffn_gate (or up), ffn_down


def stack(ggml_type: int, layers: int, huge_pages: bool) -> list[gg.BlockWeight]:
    mats = []
    for layer in range(layers):
        for rows, cols in SHAPES:
            w = random_blocks(ggml_type, rows, cols, seed=layer * 7 + rows)
            if huge_pages:
                w = gg.BlockWeight(resident_copy(w.blocks), ggml_type, rows, cols)
            mats.append(w)
    return mats


def one_pass(
    mats: list[gg.BlockWeight], xs: dict[int, torch.Tensor], outs: list[torch.Tensor], isa: str
) -> float:
    """Seconds for one decode step's products over the whole stack."""
    t0 = time.perf_counter()
    for w, out in zip(mats, outs):
        gg.gguf_gemm(xs[w.cols], [w], "q8", isa, out=out)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    p.add_argument("--isa", default=None, help="a gguf_gemm path (default: the best here)")
    p.add_argument("--rows", type=int, default=1, help="rows of x (sequences decoding together)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--huge-pages", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    isa = args.isa or gg.default_isa()
    print(f"gguf_gemm {isa}, {args.threads} threads, {args.rows} row(s) of x, {args.layers} layers")
    for name in args.types.split(","):
        if name not in TYPES:
            p.error(f"--types: {name!r} is not one of {sorted(TYPES)}")
        mats = stack(TYPES[name], args.layers, args.huge_pages)
        nbytes = sum(w.blocks.numel() for w in mats)
        xs = {cols: torch.randn(args.rows, cols) for _, cols in SHAPES}
        outs = [torch.empty(args.rows, w.rows) for w in mats]
        times = [one_pass(mats, xs, outs, isa) for _ in range(2 + args.reps)][2:]
        best, median = nbytes / min(times) / 1e9, nbytes / statistics.median(times) / 1e9
        print(
            f"{name}: {nbytes / 1e6:.0f} MB a pass, best {best:.1f} GB/s, median {median:.1f} GB/s"
        )


if __name__ == "__main__":
    main()
