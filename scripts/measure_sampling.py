"""Measure decode throughput under sampling settings: tidal.LLM, N sequences x M tokens each.

One process, one model load, a short sampled warm-up, then one `generate` per setting: the same
N prompts, `SamplingParams(max_tokens=M, ignore_eos=True, **setting)`; tok/s = output tokens /
the call's wall time (prefill included: the prompts are ~10 tokens). Run it against two trees
(PYTHONPATH=<other checkout>) alternately to compare them:

    python scripts/measure_sampling.py
    python scripts/measure_sampling.py --settings t0.8,t1.0_p0.95 --sequences 32 --tokens 64

The last line is one JSON object: setting -> tok/s.
"""

from __future__ import annotations

import argparse
import json
import time

SETTINGS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "t0.8": {"temperature": 0.8},
    "t0.8_k40_p0.95": {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
    "greedy_lp5": {"temperature": 0.0, "logprobs": 5},
    "t0.7_p0.9": {"temperature": 0.7, "top_p": 0.9},
    "t0.8_minp0.05": {"temperature": 0.8, "min_p": 0.05},
    "t1.0_p0.95": {"temperature": 1.0, "top_p": 0.95},
    "t0.8_seeded": {"temperature": 0.8, "seed": 1},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled model)")
    args = p.parse_args()
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")

    import torch

    from tidal import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model)
    prompts = [f"Story {i}: The tide comes in and" for i in range(args.sequences)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.8))
    out: dict[str, float] = {}
    for name in names:
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, **SETTINGS[name])
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        out[name] = round(sum(len(r.outputs[0].token_ids) for r in results) / elapsed, 1)
        print(f"{name}: {out[name]} tok/s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
