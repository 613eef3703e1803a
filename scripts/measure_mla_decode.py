"""Decode attention of one MLA layer over a paged latent cache: absorbed (tidal's decode path)
against expanding the cached latents to per-head K/V every step (its prefill path), side by side.

    PYTHONPATH=. python scripts/measure_mla_decode.py [--heads 16] [--context 2048] [--batch 4]

Shapes default to DeepSeek-V2-Lite (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128).
Prints one line per path and a JSON record; both paths give the same outputs (checked)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from tidal.attention.metadata import build_metadata
from tidal.attention.mla_paged import MLAPagedAttention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    rank, rope, nope, v, bs = 512, 64, 128, 128, 16
    heads, ctx, batch = args.heads, args.context, args.batch
    blocks_per_seq = -(-ctx // bs)
    cache = torch.randn(1 + batch * blocks_per_seq, bs, 1, rank + rope)
    tables = [[[1 + i * blocks_per_seq + b for b in range(blocks_per_seq)]] for i in range(batch)]
    w_uk, w_uv = torch.randn(heads, nope, rank) * 0.05, torch.randn(heads, v, rank) * 0.05
    q_nope, q_pe = torch.randn(batch, heads, nope), torch.randn(batch, heads, rope)
    latent = torch.randn(batch, rank + rope)
    attn = MLAPagedAttention()
    scale = (nope + rope) ** -0.5
    decode = build_metadata([1] * batch, [ctx] * batch, tables, bs, torch.device("cpu"))

    def absorbed() -> torch.Tensor:
        return attn.forward(q_nope, q_pe, latent, cache, decode, 0, w_uk, w_uv, scale)

    def expanded() -> torch.Tensor:  # the prefill path, one query per sequence
        out = torch.empty(batch, heads, v)
        for i in range(batch):
            meta = build_metadata([1], [ctx], [tables[i]], bs, torch.device("cpu"))
            out[i : i + 1] = attn._prefill(
                q_nope[i : i + 1], q_pe[i : i + 1], cache, meta, meta.groups[0].block_tables[0],
                0, w_uk, w_uv, scale,
            )  # fmt: skip
        return out

    with torch.inference_mode():
        a, e = absorbed(), expanded()
        max_diff = (a - e).abs().max().item()
        record = {"heads": heads, "context": ctx, "batch": batch, "max_abs_diff": max_diff}
        for name, fn in (("absorbed", absorbed), ("expanded", expanded)):
            fn()  # warm-up
            start = time.perf_counter()
            for _ in range(args.iters):
                fn()
            ms = (time.perf_counter() - start) / args.iters * 1e3
            record[f"{name}_ms"] = round(ms, 3)
            print(f"{name:9s} {ms:8.2f} ms per decode step ({batch} seqs x {ctx} tokens)")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
