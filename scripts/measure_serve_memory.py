"""Measure the memory of every `tidal serve` process after it has answered one request.

Starts `python -m tidal.cli_serve` on 127.0.0.1 (the bundled model unless arguments say otherwise),
waits for /ready, sends one greedy 32-token completion, then reads RSS, PSS and USS of the API
process and each of its children (engine, warm standby, multiprocessing's resource tracker) and
stops the server. With --burst N it then sends N concurrent greedy completions of about
--burst-prompt-tokens prompt tokens (distinct from their first word, so no prefix is shared) and
--burst-max-tokens output tokens, sampling the tree's RSS every 0.1 s while they run, and reports
the peak as well. PSS splits each shared page between the processes that map it, so its sum is
the tree's footprint; RSS counts a shared page once per process.

    python scripts/measure_serve_memory.py [--port 18123] [--burst 12] [--maps 12] [-- tidal serve arguments]

NOTE: another process that maps the same GGUF (a second server on this machine) shares its
weight pages and lowers this tree's PSS; measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil

from tidal.bench.server_probe import tree_memory_bytes


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"tidal serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def complete(base: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=1800) as resp:
        return json.loads(resp.read())


def tree_rss(root: psutil.Process) -> int:
    memory = tree_memory_bytes(root.pid)
    return 0 if memory is None else memory[0]


def burst(base: str, root: psutil.Process, n: int, prompt_tokens: int, max_tokens: int) -> dict:
    """n concurrent distinct prompts; the tree's peak RSS sampled while they run."""
    # About one token per word of this sentence on Gemma's tokenizer; a distinct first word
    # per request keeps every block of every prompt out of the others' prefix cache.
    words = "the tide comes in over the sand and goes out again under the moon".split()
    filler = " ".join(words[i % len(words)] for i in range(prompt_tokens))
    bodies = [
        {"prompt": f"{i}: {filler}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        for i in range(n)
    ]
    peak = [tree_rss(root)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], tree_rss(root))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(n) as pool:
            outs = list(pool.map(lambda b: complete(base, b), bodies))
    finally:
        done.set()
        sampler.join()
    usage = [o["usage"] for o in outs]
    return {
        "requests": n,
        "prompt_tokens": [u["prompt_tokens"] for u in usage],
        "completion_tokens": sum(u["completion_tokens"] for u in usage),
        "wall_s": round(time.monotonic() - started, 1),
        "peak_rss": peak[0],
    }


def print_largest_mappings(root: psutil.Process, n: int) -> None:
    """Each process's n largest mappings by RSS ([heap], anonymous ones, libraries, the GGUF)."""
    for p in [root, *root.children(recursive=True)]:
        maps = sorted(p.memory_maps(grouped=False), key=lambda m: m.rss, reverse=True)
        print(f"{p.pid}: {len(maps)} mappings, largest by RSS:")
        for m in maps[:n]:
            size_mib = (int(m.addr.split("-")[1], 16) - int(m.addr.split("-")[0], 16)) / 2**20
            name = m.path or "[anonymous]"
            print(f"  rss {m.rss / 2**20:7.1f} MiB of {size_mib:8.1f} MiB  {name[-60:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18123)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--burst", type=int, default=0, help="concurrent requests after the first")
    parser.add_argument("--burst-prompt-tokens", type=int, default=1000)
    parser.add_argument("--burst-max-tokens", type=int, default=64)
    parser.add_argument(
        "--maps", type=int, default=0, help="print each process's N largest mappings at the end"
    )
    parser.add_argument("serve_args", nargs="*", help="passed to tidal serve after --")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "tidal.cli_serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(args.port), *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready_s = wait_ready(base, proc, args.timeout_s)
        complete(base, {"prompt": "The tide comes in and", "max_tokens": 32, "temperature": 0})
        time.sleep(1.0)
        root = psutil.Process(proc.pid)
        rows = []
        for p in [root, *root.children(recursive=True)]:
            info = p.memory_full_info()
            name = "api" if p.pid == proc.pid else " ".join(p.cmdline())[-40:]
            rows.append(
                {"pid": p.pid, "name": name, "rss": info.rss, "pss": info.pss, "uss": info.uss}
            )
        bursts = None
        if args.burst > 0:
            bursts = burst(base, root, args.burst, args.burst_prompt_tokens, args.burst_max_tokens)
            time.sleep(1.0)
            bursts["after_rss"] = tree_rss(root)
        if args.maps > 0:
            print_largest_mappings(root, args.maps)
    finally:
        proc.terminate()
        proc.wait(30)
    for r in rows:
        print(
            f"{r['pid']:>7} rss {r['rss'] / 2**20:6.0f} MiB  pss {r['pss'] / 2**20:6.0f} MiB  "
            f"uss {r['uss'] / 2**20:6.0f} MiB  {r['name']}"
        )
    total = {k: sum(r[k] for r in rows) for k in ("rss", "pss", "uss")}
    print(f"total   rss {total['rss'] / 2**20:6.0f} MiB  pss {total['pss'] / 2**20:6.0f} MiB")
    record = {"ready_s": round(ready_s, 1), "processes": rows, "total": total}
    if bursts is not None:
        print(
            f"burst   {bursts['requests']} x ~{bursts['prompt_tokens'][0]} prompt tokens, "
            f"{bursts['completion_tokens']} generated in {bursts['wall_s']} s: peak rss "
            f"{bursts['peak_rss'] / 2**20:6.0f} MiB, after {bursts['after_rss'] / 2**20:6.0f} MiB"
        )
        record["burst"] = bursts
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
