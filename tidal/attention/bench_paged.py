"""Micro-benchmark: the paged-attention kernel against the torch reference backend, one layer.

    python -m tidal.attention.bench_paged [--threads N] [--repeat R] [--kv f32|bf16|int8|fp8]

Gemma 3 270M's attention shape (H=4, KVH=1, D=256, pages of 16): decode steps of 1 and 32
sequences at contexts 128/1024/4096 (one also through a 512-token sliding window, as 15 of its
18 layers are), 512-token prefill chunks, and a 1,024-token chunk after 5,000 tokens, global and
through the window (the long prompts that decide time to first token). Each case is seeded,
warmed up, run side by side with its baseline and reported as the median ms per layer call (the KV
write included), the kernel's GB/s of K/V pages read (what bounds decode) and its GFLOP/s
(q.k and p.v, causal: what bounds prefill). One JSON record per case follows.

A development tool: unlike the rest of tidal.kernels it imports the attention backends (one
layer up) for its baseline and metadata.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 1, 256, 16
SCALE = HEAD_DIM**-0.5
_QUANT = ("int8", "fp8")


def _time_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: builds the library, touches the pages
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _case(
    name: str,
    query_lens: list[int],
    context_lens: list[int],
    kv: str,
    repeat: int,
    window: int | None = None,
) -> dict[str, object]:
    from tidal.attention.cpu_paged import CpuPagedAttention
    from tidal.attention.kv_quant import QuantizedKV, allocate_quantized_pool
    from tidal.attention.metadata import build_metadata
    from tidal.attention.torch_paged import TorchPagedAttention

    g = torch.Generator().manual_seed(0)
    blocks_per_seq = [-(-c // BLOCK_SIZE) for c in context_lens]
    num_blocks = 1 + sum(blocks_per_seq)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered pages
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append([ids[at : at + n]])
        at += n
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if kv in _QUANT:
        data, scale = allocate_quantized_pool(1, *shape, kv, "cpu")
        caches = (
            QuantizedKV(data[0, 0], scale[0, 0], kv),
            QuantizedKV(data[0, 1], scale[0, 1], kv),
        )
    else:
        dtype = torch.bfloat16 if kv == "bf16" else torch.float32
        caches = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    # Every page filled (the step then rewrites its own tokens' slots).
    slots = torch.arange(num_blocks * BLOCK_SIZE)
    for cache in caches:
        x = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g)
        if isinstance(cache, QuantizedKV):
            cache.write(slots, x)
        else:
            cache.view(-1, KV_HEADS, HEAD_DIM).copy_(x)
    meta = build_metadata(query_lens, context_lens, tables, BLOCK_SIZE, torch.device("cpu"))
    n = sum(query_lens)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
    kernel, reference = CpuPagedAttention(), TorchPagedAttention()
    args = (q, k, v, *caches, meta, 0, window, SCALE)
    diff = float((kernel.forward(*args) - reference.forward(*args)).abs().max())
    kernel_ms = _time_ms(lambda: kernel.forward(*args), repeat)
    reference_ms = _time_ms(lambda: reference.forward(*args), repeat)
    elem_bytes = {"f32": 4, "bf16": 2}.get(kv, 1)
    # keys seen per query: positions lo..p for the query at p
    keys = sum(
        min(p + 1, window or p + 1)
        for n, c in zip(query_lens, context_lens)
        for p in range(c - n, c)
    )
    # pages read: each sequence's keys from its first query's lo to its end
    pages = sum(c - max(0, c - n - (window or c) + 1) for n, c in zip(query_lens, context_lens))
    kv_bytes = pages * KV_HEADS * HEAD_DIM * 2 * elem_bytes
    flops = 4 * HEADS * HEAD_DIM * keys
    return {
        "case": name,
        "kv": kv,
        "threads": torch.get_num_threads(),
        "kernel_ms": round(kernel_ms, 4),
        "reference_ms": round(reference_ms, 4),
        "speedup": round(reference_ms / kernel_ms, 2),
        "kernel_kv_gb_s": round(kv_bytes / kernel_ms / 1e6, 2),
        "kernel_gflop_s": round(flops / kernel_ms / 1e6, 2),
        "max_abs_diff": diff,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--kv", choices=["f32", "bf16", *_QUANT], default="f32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases: list[tuple[str, list[int], list[int], int | None]] = [
        (f"decode {b} seq ctx {c}", [1] * b, [c] * b, None)
        for b in (1, 32)
        for c in (128, 1024, 4096)
    ]
    cases.append(("decode 32 seq ctx 4096 win 512", [1] * 32, [4096] * 32, 512))  # sliding
    cases.append(("prefill chunk 512 from 0", [512], [512], None))
    cases.append(("prefill chunk 512 after 1024", [512], [1536], None))
    # the long-prompt work: a 6,000-token prompt's last 1,024-token chunk, global and sliding
    cases.append(("prefill chunk 1024 after 5000", [1024], [6024], None))
    cases.append(("prefill 1024 after 5000 win 512", [1024], [6024], 512))
    records = []
    print(
        f"{'case':<32}{'kernel ms':>11}{'torch ms':>11}{'speedup':>9}{'KV GB/s':>9}"
        f"{'GFLOP/s':>9}{'max diff':>10}"
    )
    for name, query_lens, context_lens, window in cases:
        r = _case(name, query_lens, context_lens, args.kv, args.repeat, window)
        records.append(r)
        print(
            f"{name:<32}{r['kernel_ms']:>11.3f}{r['reference_ms']:>11.3f}{r['speedup']:>8.1f}x"
            f"{r['kernel_kv_gb_s']:>9.1f}{r['kernel_gflop_s']:>9.1f}{r['max_abs_diff']:>10.1e}"
        )
    for r in records:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
