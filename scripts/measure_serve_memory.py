"""Measure the memory of every `tidal serve` process after it has answered one request.

Starts `python -m tidal.cli_serve` on 127.0.0.1 (the bundled model unless arguments say otherwise),
waits for /ready, sends one greedy 32-token completion, then reads RSS, PSS and USS of the API
process and each of its children (engine, warm standby, multiprocessing's resource tracker) and
stops the server. PSS splits each shared page between the processes that map it, so its sum is
the tree's footprint; RSS counts a shared page once per process.

    python scripts/measure_serve_memory.py [--port 18123] [-- extra tidal serve arguments]

NOTE: another process that maps the same GGUF (a second server on this machine) shares its
weight pages and lowers this tree's PSS; measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request

import psutil


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18123)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("serve_args", nargs="*", help="passed to tidal serve after --")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "tidal.cli_serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(args.port), *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready_s = wait_ready(base, proc, args.timeout_s)
        body = {"prompt": "The tide comes in and", "max_tokens": 32, "temperature": 0}
        req = urllib.request.Request(
            base + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
        time.sleep(1.0)
        root = psutil.Process(proc.pid)
        rows = []
        for p in [root, *root.children(recursive=True)]:
            info = p.memory_full_info()
            name = "api" if p.pid == proc.pid else " ".join(p.cmdline())[-40:]
            rows.append(
                {"pid": p.pid, "name": name, "rss": info.rss, "pss": info.pss, "uss": info.uss}
            )
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
    print(json.dumps({"ready_s": round(ready_s, 1), "processes": rows, "total": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
