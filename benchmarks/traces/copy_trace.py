"""Write the copy-heavy trace of benchmarks/README.md ("Prompt-lookup speculative decoding"):
prompts that quote ~1,200 characters of one of tidal's source files and ask for it again,
for `tidal bench compare --workload jsonl --jsonl FILE`.

    python benchmarks/traces/copy_trace.py /tmp/copy.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_trace(num_requests: int = 16, max_tokens: int = 128, seed: int = 0) -> list[dict]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tidal").rglob("*.py"))
    random.Random(seed).shuffle(files)
    out = []
    for name in files:
        src = (ROOT / name).read_text()
        if len(src) < 1500:
            continue
        body = src[:1200]
        head = "\n".join(body.splitlines()[:3])
        prompt = f"# {name}\n{body}\n\n# The same file again, unchanged:\n{head}\n"
        out.append({"prompt": prompt, "max_tokens": max_tokens})
        if len(out) == num_requests:
            break
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        for row in copy_trace():
            f.write(json.dumps(row) + "\n")
