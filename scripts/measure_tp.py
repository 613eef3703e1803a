"""Measure tensor parallelism on CPU: per-rank memory, decode speed, and the collectives' cost.

    python scripts/measure_tp.py [--model PATH] [--quantization auto] [--tokens 48]

For tensor_parallel 1 and 2 it starts a fresh `python scripts/measure_tp.py --one N` (so each
process's RSS is its own), which builds `tidal.LLM(tensor_parallel_size=N)`, runs one greedy
warm-up and one timed single-sequence decode, and reports decode ms/token, the tensor bytes of
rank 0's model (a mmapped GGUF row slice counts its own bytes, not the file's) and the RSS of every
rank after decoding. Then it times, between two local gloo ranks, one decode step's collectives
alone (the model's 1 + 2 * layers all-reduces of a (1, hidden) float32 row, one all-gather of
(1, vocab / 2) logits, the two step broadcasts), 200 times. Prints one JSON record per part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import psutil

# A small KV pool, so the RSS figures are mostly weights (the pool is zero-filled, so resident).
KV_BYTES = 32 << 20


def tensor_bytes(model) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def one(n: int, model: str | None, quantization: str, tokens: int) -> dict:
    from tidal import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=n, quantization=quantization, kv_cache_bytes=KV_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = "The tide comes in and the tide goes out, and"
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    elapsed = time.perf_counter() - start
    m = out.metrics
    decode_s = (m.last_token_time_s - m.first_token_time_s) if m is not None else elapsed
    me = psutil.Process()
    workers = [
        c for c in me.children(recursive=True) if "tidal.executor.worker" in " ".join(c.cmdline())
    ]
    record = {
        "tensor_parallel": n,
        "threads_per_rank": __import__("torch").get_num_threads(),
        "decode_ms_per_token": round(1000 * decode_s / max(1, tokens - 1), 2),
        "rank0_model_tensor_mib": round(tensor_bytes(llm.engine.runner.model) / 2**20, 1),
        "rss_mib_by_rank": [round(p.memory_info().rss / 2**20) for p in [me, *workers]],
        "kv_blocks": llm.engine.num_blocks,
        "tokens": out.outputs[0].token_ids[:8],
    }
    llm.shutdown()
    return record


def _collectives(rank: int, world: int, port: int, hidden: int, vocab: int, layers: int, q) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))  # fmt: skip
    row = torch.randn(1, hidden)
    logits = torch.randn(1, vocab // world)
    parts = [torch.empty_like(logits) for _ in range(world)]
    header, payload = torch.zeros(2, dtype=torch.long), torch.zeros(24, dtype=torch.long)

    def step() -> None:
        dist.broadcast(header, 0)
        dist.broadcast(payload, 0)
        for _ in range(1 + 2 * layers):
            dist.all_reduce(row)
        dist.all_gather(parts, logits)

    for _ in range(20):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(200):
        step()
    per_step = (time.perf_counter() - start) / 200
    ar = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(row)
    per_ar = (time.perf_counter() - ar) / 200
    if rank == 0:
        q.put({"collectives_ms_per_decode_step": round(1000 * per_step, 3),
               "all_reduce_us_one_row": round(1e6 * per_ar, 1),
               "all_reduces_per_step": 1 + 2 * layers, "hidden": hidden, "vocab": vocab})  # fmt: skip
    dist.destroy_process_group()


def collectives(model: str | None) -> dict:
    import multiprocessing as mp
    import socket

    from tidal.engine.builder import model_path
    from tidal.engine.llm import engine_config_from_kwargs
    from tidal.loader.model_loader import read_arch

    arch = read_arch(model_path(engine_config_from_kwargs(model)))[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (2, port, arch.hidden_size, arch.vocab_size, arch.num_layers, q)
    procs = [ctx.Process(target=_collectives, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    out = q.get(timeout=300)
    for p in procs:
        p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.model, args.quantization, args.tokens)))
        return
    for n in (1, 2):
        cmd = [sys.executable, __file__, "--one", str(n), "--quantization", args.quantization,
               "--tokens", str(args.tokens)] + (["--model", args.model] if args.model else [])  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
        print(out.stdout.strip().splitlines()[-1], flush=True)
    print(json.dumps(collectives(args.model)))


if __name__ == "__main__":
    main()
