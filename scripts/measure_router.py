"""The router's added latency per request: hashing the prompt's blocks, matching them against each
replica's prefix index, choosing, recording; seeded, warmed up, one line per prompt length.

    python scripts/measure_router.py [--replicas 2] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tidal.router.policy import ReplicaLoad, RoutingPolicy
from tidal.router.prefix_index import PrefixIndex, prompt_block_hashes

BLOCK_SIZE = 16


def measure(num_replicas: int, num_tokens: int, num_requests: int, seed: int) -> float:
    """Mean microseconds per routed request, the indexes warm with earlier prompts."""
    rng = random.Random(seed)
    policy = RoutingPolicy(num_replicas)
    index = PrefixIndex(65536)
    keys = range(num_replicas)
    system = [rng.randrange(256000) for _ in range(num_tokens // 2)]  # a shared half
    prompts = [system + [rng.randrange(256000) for _ in range(num_tokens - len(system))]
               for _ in range(64)]  # fmt: skip
    loads = [ReplicaLoad(True, rng.randrange(8), 0.1) for _ in range(num_replicas)]

    def route(k: int) -> None:
        tokens = prompts[k % len(prompts)]
        hashes = prompt_block_hashes(tokens, BLOCK_SIZE)
        r = policy.choose(loads, index.match(keys, hashes), len(hashes), f"s{k % 97}")
        index.add(r.replica, hashes)

    for k in range(200):  # warm-up
        route(k)
    start = time.perf_counter()
    for k in range(num_requests):
        route(k)
    return (time.perf_counter() - start) / num_requests * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    records = []
    for num_tokens in (128, 1024, 4096):
        us = measure(args.replicas, num_tokens, args.requests, args.seed)
        print(f"router: {args.replicas} replicas, {num_tokens}-token prompt: {us:.1f} us/request")
        records.append(
            {"replicas": args.replicas, "prompt_tokens": num_tokens, "us_per_request": us}
        )
    print(json.dumps(records))


if __name__ == "__main__":
    main()
