"""The quantization table: bytes, perplexity, top-1 agreement and decode speed per scheme, one run.

    python -m tidal.bench.quant_table --json quant.json --markdown quant.md

For every scheme the model is loaded afresh and quantized; the accuracy columns come from the gate's
arithmetic (tidal.worker.gate: the held-out text through the paged KV cache, against the float
model's scores computed once), the speed columns from the engine (tidal.LLM) decoding greedy
tokens for 1, 8 and 32 sequences together, as `python -m tidal.bench.offline --mode decode` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.config.quant import NATIVE_SCHEMES, SCHEMES

# Every scheme a table can measure: "auto" only stands for one of them.
TABLE_SCHEMES = tuple(s for s in SCHEMES if s != "auto")


def _scores(path: str, scheme: str, ids: list[int], context: int):
    from tidal.loader.model_loader import load_model
    from tidal.quant.registry import quantize_model, weight_bytes
    from tidal.worker.gate import score_tokens

    # The GGUF schemes run the file's own blocks: a load of their own, not a swap of float weights.
    loaded = load_model(path, gguf_blocks=scheme in NATIVE_SCHEMES)
    if scheme != "none":
        quantize_model(loaded.model, scheme)
    scores = score_tokens(loaded, ids, context)
    return scores, weight_bytes(loaded.model)


def _speed(path: str, scheme: str, args: argparse.Namespace) -> dict[str, float]:
    from tidal import LLM
    from tidal.bench.offline import _decode_rate, _prefill_rate

    kwargs: dict[str, Any] = {
        "quantization": scheme,
        "quantization_gate": False,  # this run measures the gate's figures itself
        "enable_prefix_caching": False,  # repeated prompts must compute every token
        "max_num_seqs": max(args.decode_batches),
        "dtype": args.dtype,
    }
    if args.threads is not None:
        kwargs["threads"] = args.threads
    llm = LLM(path, **kwargs)
    vocab = llm.engine.loaded.arch.vocab_size
    _decode_rate(llm, max(args.decode_batches), 16, 4, vocab)  # warm-up, excluded
    out = {
        f"decode_x{b}": _decode_rate(llm, b, 16, args.decode_tokens, vocab)
        for b in args.decode_batches
    }
    out["prefill_tok_s"] = _prefill_rate(llm, args.prefill_len, vocab)
    del llm
    gc.collect()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tidal.loader.model_loader import load_model
    from tidal.loader.tokenizer import load_tokenizer
    from tidal.worker.gate import compare, heldout_text

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from tidal.loader.bundled import bundled_model_path

        path = str(bundled_model_path())
    arch = load_model(path).arch
    ids = load_tokenizer(path, arch.family).encode(heldout_text())
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    context = min(arch.max_position_embeddings, 4096)
    started = time.perf_counter()
    ref, ref_bytes = _scores(path, "none", ids, context)
    rows: list[dict[str, Any]] = []
    for scheme in args.schemes:
        scores, nbytes = (
            (ref, ref_bytes) if scheme == "none" else _scores(path, scheme, ids, context)
        )
        report = compare(ref, scores, scheme, context, args.threshold_pct)
        row: dict[str, Any] = {
            "scheme": scheme,
            "weight_bytes": nbytes,
            "ppl": report.ppl_quant,
            "ppl_change_pct": report.change_pct,
            "top1_agreement": report.top1_agreement,
            "passes_gate": report.passed,
        }
        row.update(_speed(path, scheme, args))
        rows.append(row)
        print(_line(row, args.decode_batches), flush=True)
    return {
        "model": path,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "tokens_scored": ref.nll.numel(),
        "decode_tokens": args.decode_tokens,
        "threshold_pct": args.threshold_pct,
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }


def _line(row: dict[str, Any], batches: Sequence[int]) -> str:
    speeds = " ".join(f"x{b} {row[f'decode_x{b}']:.1f}" for b in batches)
    return (
        f"{row['scheme']:<5} {row['weight_bytes'] / 1e6:7.0f} MB  ppl {row['ppl']:.3f} "
        f"({row['ppl_change_pct']:+.2f}%)  top-1 {100 * row['top1_agreement']:.1f}%  "
        f"decode tok/s {speeds}  prefill {row['prefill_tok_s']:.0f} tok/s"
    )


def markdown(record: dict[str, Any], batches: Sequence[int]) -> str:
    head = "| scheme | weights | perplexity | change | top-1 agreement | "
    head += " | ".join(f"decode x{b} tok/s" for b in batches) + " | prefill tok/s |"
    sep = "|" + "---|" * (6 + len(batches))
    lines = [head, sep]
    for r in record["rows"]:
        speeds = " | ".join(f"{r[f'decode_x{b}']:.1f}" for b in batches)
        lines.append(
            f"| {r['scheme']} | {r['weight_bytes'] / 1e6:.0f} MB | {r['ppl']:.3f} | "
            f"{r['ppl_change_pct']:+.2f}% | {100 * r['top1_agreement']:.1f}% | {speeds} | "
            f"{r['prefill_tok_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from tidal.bench.offline import _int_list

    p = argparse.ArgumentParser(prog="python -m tidal.bench.quant_table", description=__doc__)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled)")
    p.add_argument("--schemes", default=",".join(TABLE_SCHEMES), help="comma-separated")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--decode-batches", type=_int_list, default=(1, 8, 32))
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=None, help="truncate the held-out text")
    p.add_argument("--threshold-pct", type=float, default=1.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in args.schemes if s not in TABLE_SCHEMES]
    if bad or not args.schemes:
        expected = ", ".join(TABLE_SCHEMES)
        p.error(f"--schemes={','.join(bad) or '(empty)'} is invalid: expected {expected}")
    if args.decode_tokens < 2:
        p.error(f"--decode-tokens={args.decode_tokens} is invalid: expected an integer >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = run(args)
    table = markdown(record, args.decode_batches)
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.markdown is not None:
        args.markdown.write_text(table)
        print(f"wrote {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
