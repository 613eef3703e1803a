"""Micro-benchmark of gguf_gemm on the bundled model's shapes, side by side with torch and int8_gemm.

python -m tidal.kernels.bench_gguf [--reps 20] [--threads N] [--clock wall|thread] [--json F]
                                   [--isas avx512,avx2] [--gguf-only]

Times are the best of --reps calls after two warm-ups (what the machine can do, not how busy it
is; the median goes to the JSON records). --isas times the gguf paths on each ISA named, side by
side in one run (default: the default path only); --gguf-only leaves out torch and int8_gemm. --clock thread times the calling thread's CPU time:
with --threads 1 it ignores time slices lost to other processes on a shared machine. GB/s counts the weight bytes each path reads: the packed
blocks for gguf, float32 for torch, int8 codes + scales for int8_gemm. gguf and torch write
into one output made beforehand, as the engine's logits buffer is: a fresh (32, 262144) float32
output every call is 32 MiB that glibc maps afresh and the kernel faults in page by page: one
thread's call took 40 ms that way against 26 ms into a kept output (Zen 5).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tidal.kernels import gguf_gemm as gg
from tidal.kernels.int8_gemm import int8_gemm

# Gemma 3 270M Q4_K_M: (name, ggml type, rows N, cols K)
SHAPES = (
    ("lm_head", 8, 262144, 640),
    ("q_proj", 6, 1024, 640),
    ("gate", 6, 2048, 640),
    ("down", 12, 640, 2048),
    ("down", 14, 640, 2048),
)
BATCHES = (1, 8, 32)


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int = 0) -> gg.BlockWeight:
    """Valid blocks of random codes: speed does not depend on the values, only on the format."""
    name, elems, nbytes = gg._BLOCKS[ggml_type]
    rng = np.random.default_rng(seed)
    nb = cols // elems
    b = rng.integers(0, 256, size=(rows, nb, nbytes), dtype=np.uint8)
    scale = (rng.uniform(0.5, 2.0, size=(rows, nb, 2)) * 1e-2).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        b[..., 208:210] = scale[..., 0:2]
    else:
        b[..., 0:2] = scale[..., 0:2]
        if name in ("Q4_K", "Q5_K"):
            b[..., 2:4] = scale[..., 2:4]
    return gg.BlockWeight(torch.from_numpy(b.reshape(rows, nb * nbytes)), ggml_type, rows, cols)


def timed(
    fn: Callable[[], object], reps: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """(best, median) seconds per call after two warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times), float(np.median(times))


def dequant_matmul(x: torch.Tensor, w: gg.BlockWeight) -> torch.Tensor:
    """The prefill route: decode all of W to float32, then torch's matmul."""
    wf = gg.dequantize_rows(w, 0, w.rows)
    assert wf is not None
    return torch.nn.functional.linear(x, wf)


def paths(
    x: torch.Tensor,
    w: gg.BlockWeight,
    baseline: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    isas: Sequence[str] = (),
) -> list[tuple[str, Callable[[], object], int]]:
    """(label, call, weight bytes read) for each path on one shape and batch: the gguf ones on
    each of `isas` (default: the default path), then torch's and int8_gemm's on `baseline`
    (float32 weights, int8 codes, scales) unless it is None."""
    n, k = w.rows, w.cols
    out = torch.empty(x.shape[0], n)
    found = [
        (
            f"gguf {act} {isa}",
            functools.partial(gg.gguf_gemm, x, [w], act, isa, out=out),
            w.blocks.numel(),
        )
        for act in gg.ACTS
        for isa in (isas or [gg.default_isa()])
    ]
    if baseline is None:
        return found
    wf, codes, scales = baseline
    found += [
        ("torch f32", functools.partial(torch.mm, x, wf.t(), out=out), n * k * 4),
        ("int8_gemm", functools.partial(int8_gemm, x, codes, scales, None), n * k * 9 // 8),
    ]
    if x.shape[0] == 32:
        found.append(("dequant+torch", functools.partial(dequant_matmul, x, w), w.blocks.numel()))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--clock", choices=("wall", "thread"), default="wall")
    p.add_argument("--json", default=None, help="write every record (best and median) here")
    p.add_argument("--isas", default="", help="comma-separated gguf paths to time side by side")
    p.add_argument("--gguf-only", action="store_true", help="leave out torch and int8_gemm")
    args = p.parse_args()
    isas = [name for name in args.isas.split(",") if name]
    for name in isas:
        if name not in gg.isas():
            p.error(f"--isas: {name!r} does not run here; this machine runs {gg.isas()}")
    if args.clock == "thread" and args.threads != 1:
        p.error("--clock thread needs --threads 1 (other threads' time is not counted)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"gguf_gemm isas {gg.isas()}, default {gg.default_isa()}, threads {args.threads}, "
        f"clock {args.clock}"
    )
    print(f"{'shape':<25}{'M':>3}  {'path':<17}{'us/call':>10}{'GB/s':>8}{'GFLOP/s':>9}")
    if not gg.available():
        raise SystemExit("the gguf_gemm library did not build: nothing to measure")
    records = []
    for name, t, n, k in SHAPES:
        w = random_blocks(t, n, k)
        baseline = None
        if not args.gguf_only:  # (N, K) float32 for torch, int8 codes + scales for int8_gemm
            baseline = (
                gg.dequantize_rows(w, 0, n),
                torch.randint(-127, 128, (n, k), dtype=torch.int8),
                torch.rand(n, k // 32) * 1e-2,
            )
        label = f"{name} {n}x{k} {gg._BLOCKS[t][0]}"
        for m in BATCHES:
            x = torch.randn(m, k)
            for path, fn, weight_bytes in paths(x, w, baseline, isas):
                best, median = timed(fn, args.reps if path != "dequant+torch" else 3, clock)
                gbs, gflops = weight_bytes / best / 1e9, 2 * m * n * k / best / 1e9
                print(f"{label:<25}{m:>3}  {path:<17}{best * 1e6:>10.1f}{gbs:>8.1f}{gflops:>9.1f}")
                records.append(
                    {"shape": label, "m": m, "path": path, "best_us": best * 1e6,
                     "median_us": median * 1e6, "gbs": gbs, "gflops": gflops}
                )  # fmt: skip
        del baseline
    head = {
        r["path"]: round(r["gbs"], 1) for r in records if r["m"] == 1 and "lm_head" in r["shape"]
    }
    print(json.dumps({"bench": "gguf_gemm", "threads": args.threads, "lm_head_m1_gbs": head}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
