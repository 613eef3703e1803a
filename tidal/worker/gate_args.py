"""The `tidal quantize-check` command line, without torch.

`tidal serve` builds the whole CLI parser in its API process, which never runs a model; keeping
this parser apart from the gate itself keeps torch (some 250 MB of resident memory) out of that
process. The gate is imported when the command runs.
"""

from __future__ import annotations

import argparse

from tidal.config.cache import KV_CACHE_DTYPES
from tidal.config.quant import SCHEMES


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize-check",
        help="perplexity and top-1 agreement of a quantized model vs float on held-out text",
    )
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled)")
    p.add_argument(
        "--quantization",
        default="none",
        choices=[s for s in SCHEMES if s != "auto"],
        help="weight format ('gguf': the file's blocks through tidal's kernels)",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV cache storage"
    )
    p.add_argument("--threshold-pct", type=float, default=1.0, help="allowed perplexity rise, %%")
    p.add_argument("--context-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--force", action="store_true", help="exit 0 even when the gate fails")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from tidal.worker.gate import run

    return run(args)
