"""In-process A/B of two builds of the paged-attention kernel on Gemma 3 270M-shaped steps.

    python scripts/ab_paged_attention.py [--base HEAD~1] [--kv f16|f32] [--isa avx2|avx512] [--reps 11]

Builds tidal/kernels/paged_attention.c as it is in the working tree and as it was at --base
(git), with build.py's flags, loads both into this process and times them alternating on the
same inputs: prompts of 1024 tokens (a global and a 512-token sliding layer), a 512-token chunk
after 512 cached ones, a 1024-token chunk after 4096 (a long prompt's later chunks), and 32
decodes over 600 keys each, on --isa (default: this machine's best). It first checks that both builds give
the same bits on every case. Separate processes on a shared host swing far more than the
difference measured here; one process, alternating calls, best of --reps, does not.
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

from tidal.kernels import paged_attention as pa  # noqa: E402
from tidal.kernels.build import _FLAGS  # noqa: E402

H, KVH, D, BS = 4, 1, 256, 16  # Gemma 3 270M: 4 query heads on 1 kv head of 256, pages of 16


def build(src_dir: Path, out: Path) -> ctypes.CDLL:
    cmd = ["gcc", *_FLAGS, f"-I{src_dir}", str(src_dir / "paged_attention.c"), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.tidal_paged_attention.restype = ctypes.c_int
    lib.tidal_paged_attention.argtypes = [ctypes.c_char_p]
    return lib


def sources_at(rev: str, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("paged_attention.c", "tidal_kernels.h"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:tidal/kernels/{name}"],
                              check=True, capture_output=True).stdout  # fmt: skip
        (dst / name).write_bytes(text)
    return dst


def make_case(prior: int, new: int, window: int | None, seqs: int, dtype: torch.dtype):
    """`seqs` sequences, each with `prior` cached tokens and `new` tokens in this step."""
    ctx = prior + new
    nb = (ctx + BS - 1) // BS
    kp = torch.randn(nb * seqs + 1, BS, KVH, D).to(dtype)
    vp = torch.randn(nb * seqs + 1, BS, KVH, D).to(dtype)
    q, k, v = (
        torch.randn(new * seqs, H, D),
        torch.randn(new * seqs, KVH, D),
        torch.randn(new * seqs, KVH, D),
    )
    perm = torch.randperm(nb * seqs)
    tables = perm.view(seqs, nb).long()
    pos = torch.arange(prior, ctx)
    slots = torch.cat([tables[i][pos // BS] * BS + pos % BS for i in range(seqs)])
    arrays = torch.tensor(
        [[i * new for i in range(seqs)], [new] * seqs, [ctx] * seqs], dtype=torch.int32
    )
    return q, k, v, kp, vp, slots, tables, arrays, window


def call(lib: ctypes.CDLL, case, kv_type: int, isa: int) -> torch.Tensor:
    q, k, v, kp, vp, slots, tables, arrays, window = case
    # (each call writes the step's K/V into the same slots: the same bytes every time)
    out = torch.empty_like(q)
    packed = pa._ARGS.pack(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), H * D, KVH * D, KVH * D, out.data_ptr(),
        q.shape[0], H, KVH, D, kp.data_ptr(), vp.data_ptr(), 0, 0, kv_type, BS,
        slots.data_ptr(), tables.data_ptr(), tables.shape[1], arrays.data_ptr(), arrays.shape[1],
        window or 0, D**-0.5, 0.0, isa, torch.get_num_threads(),
    )  # fmt: skip
    if lib.tidal_paged_attention(packed) != 0:
        raise MemoryError("paged_attention: scratch allocation failed")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="HEAD~1", help="git revision to compare the working tree with")
    p.add_argument("--kv", choices=("f16", "f32"), default="f16", help="page type")
    p.add_argument("--isa", choices=("avx2", "avx512"), help="kernel path (default: the best here)")
    p.add_argument("--reps", type=int, default=11)
    args = p.parse_args()
    isa = {"avx2": pa.ISA_AVX2, "avx512": pa.ISA_AVX512}.get(args.isa, pa.default_isa())
    if isa not in pa.isas() or isa == pa.ISA_SCALAR:
        sys.exit(f"this machine has no {args.isa or 'AVX2+FMA+F16C'} path to compare")
    dtype, kv_type = (torch.float16, pa.KV_F16) if args.kv == "f16" else (torch.float32, pa.KV_F32)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            args.base: build(sources_at(args.base, Path(tmp) / "base"), Path(tmp) / "base.so"),
            "working tree": build(ROOT / "tidal" / "kernels", Path(tmp) / "new.so"),
        }
        cases = {
            "1024-token prompt, global": make_case(0, 1024, None, 1, dtype),
            "1024-token prompt, window 512": make_case(0, 1024, 512, 1, dtype),
            "512-token chunk after 512": make_case(512, 512, None, 1, dtype),
            "1024-token chunk after 4096": make_case(4096, 1024, None, 1, dtype),
            "32 decodes over 600 keys": make_case(600, 1, None, 32, dtype),
        }
        isa_name = {pa.ISA_AVX2: "avx2", pa.ISA_AVX512: "avx512"}[isa]
        print(
            f"threads {torch.get_num_threads()}, {args.kv} pages, {isa_name}, best of {args.reps} (ms)"
        )
        print(f"| step | {' | '.join(libs)} | ratio |\n|---|---|---|---|")
        for name, case in cases.items():
            outs = [call(lib, case, kv_type, isa) for lib in libs.values()]
            same = torch.equal(outs[0], outs[1])
            best = {n: float("inf") for n in libs}
            for _ in range(args.reps):
                for n, lib in libs.items():
                    t0 = time.perf_counter()
                    call(lib, case, kv_type, isa)
                    best[n] = min(best[n], time.perf_counter() - t0)
            a, b = best.values()
            flag = "" if same else " (bits differ)"
            print(f"| {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}x{flag} |", flush=True)


if __name__ == "__main__":
    main()
