"""Offline benchmark: tidal.LLM against the static-batching baseline on one seeded workload."""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tidal.bench.static_batching import StaticBatcher
from tidal.bench.workload import WorkItem, make_workload

_THROUGHPUT = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
_LATENCY = ("latency_mean_s", "latency_p50_s", "latency_p99_s", "ttft_mean_s")


@dataclass(slots=True)
class RunSummary:
    """One system's pass over the workload; latencies are from the common start (all arrive at 0)."""

    name: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_mean_s: float

    def line(self) -> str:
        return (
            f"{self.name:<7} {self.num_requests} reqs in {self.elapsed_s:.2f} s | "
            f"{self.requests_per_s:.3f} req/s | {self.output_tokens_per_s:.1f} out tok/s | "
            f"{self.total_tokens_per_s:.1f} total tok/s | latency mean {self.latency_mean_s:.2f} s "
            f"p50 {self.latency_p50_s:.2f} s p99 {self.latency_p99_s:.2f} s | "
            f"ttft mean {self.ttft_mean_s:.2f} s"
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's)."""
    if not values:
        raise ValueError("percentile of no values: expected at least one")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(
    name: str,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    latencies_s: Sequence[float],
    ttfts_s: Sequence[float],
    elapsed_s: float,
) -> RunSummary:
    n_prompt, n_out = sum(prompt_lens), sum(output_lens)
    return RunSummary(
        name=name,
        num_requests=len(prompt_lens),
        num_prompt_tokens=n_prompt,
        num_output_tokens=n_out,
        elapsed_s=elapsed_s,
        requests_per_s=len(prompt_lens) / elapsed_s,
        output_tokens_per_s=n_out / elapsed_s,
        total_tokens_per_s=(n_prompt + n_out) / elapsed_s,
        latency_mean_s=sum(latencies_s) / len(latencies_s),
        latency_p50_s=percentile(latencies_s, 50),
        latency_p99_s=percentile(latencies_s, 99),
        ttft_mean_s=sum(ttfts_s) / len(ttfts_s),
    )


def _params(max_tokens: int):
    from tidal import SamplingParams

    # Greedy and ignore_eos: both systems then produce exactly max_tokens per request.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_tidal(llm, work: list[WorkItem]) -> tuple[RunSummary, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(
        prompt_token_ids=[w.prompt_token_ids for w in work],
        sampling_params=[_params(w.max_tokens) for w in work],
    )
    elapsed = time.perf_counter() - start
    # Engine-clock times; every request arrived within one generate() call, so the earliest
    # arrival is the common start.
    t0 = min(o.metrics.arrival_time_s for o in outs)
    summary = summarize(
        "tidal",
        [len(o.prompt_token_ids) for o in outs],
        [len(o.outputs[0].token_ids) for o in outs],
        [o.metrics.finished_time_s - t0 for o in outs],
        [o.metrics.first_token_time_s - t0 for o in outs],
        elapsed,
    )
    return summary, [list(o.outputs[0].token_ids) for o in outs]


def run_static(batcher: StaticBatcher, work: list[WorkItem]) -> tuple[RunSummary, list[list[int]]]:
    start = time.perf_counter()
    t0 = batcher.clock()
    results = batcher.generate(
        [w.prompt_token_ids for w in work], [w.max_tokens for w in work], ignore_eos=True
    )
    elapsed = time.perf_counter() - start
    # A row's latency is when it produced its last token: generous to the baseline, whose
    # results a real static server would only return when the whole batch ends.
    summary = summarize(
        "static",
        [len(r.prompt_token_ids) for r in results],
        [len(r.token_ids) for r in results],
        [r.finished_time_s - t0 for r in results],
        [r.first_token_time_s - t0 for r in results],
        elapsed,
    )
    return summary, [r.token_ids for r in results]


def cpu_flags() -> list[str]:
    """The SIMD/matrix extensions that decide CPU matmul speed (avx2, avx512*, amx*)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted(set(re.findall(r"\b(avx2|avx512\w*|amx\w*)\b", text)))


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings both systems share, so that only the schedule differs."""
    kwargs: dict[str, Any] = {"dtype": args.dtype}
    if args.threads is not None:
        kwargs["threads"] = args.threads
    if args.kv_cache_bytes is not None:
        kwargs["kv_cache_bytes"] = args.kv_cache_bytes
    return kwargs


def _build_llm(args: argparse.Namespace, max_num_seqs: int, **extra: Any):
    from tidal import LLM

    return LLM(args.model, **_llm_kwargs(args), max_num_seqs=max_num_seqs, **extra)


def _environment(args: argparse.Namespace, llm) -> dict[str, Any]:
    import torch

    loaded = llm.engine.loaded
    return {
        "model": str(loaded.path),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "seed": args.seed,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
    }


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    llm = _build_llm(args, args.max_num_seqs)
    loaded = llm.engine.loaded
    tok = llm.get_tokenizer()
    work = make_workload(
        args.num_prompts,
        args.seed,
        loaded.arch.vocab_size,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        bos_token_id=tok.bos_token_id,
    )
    # The baseline is tidal's engine on a static schedule (an engine of its own, loaded with the
    # same settings): the comparison isolates the scheduling policy.
    batcher = StaticBatcher(
        args.model, args.batch_size, block_size=llm.config.cache.block_size, **_llm_kwargs(args)
    )
    # Warm-up, excluded from timing: a few short requests through both systems.
    warm = make_workload(
        min(2, args.num_prompts), args.seed + 1, loaded.arch.vocab_size,
        min_prompt_len=4, max_prompt_len=16, min_tokens=2, max_tokens=4,
    )  # fmt: skip
    run_tidal(llm, warm)
    run_static(batcher, warm)
    tidal_summary, tidal_tokens = run_tidal(llm, work)
    print(tidal_summary.line(), flush=True)
    static_summary, static_tokens = run_static(batcher, work)
    print(static_summary.line(), flush=True)
    ratio = {k: getattr(tidal_summary, k) / getattr(static_summary, k) for k in _THROUGHPUT}
    ratio.update({k: getattr(tidal_summary, k) / getattr(static_summary, k) for k in _LATENCY})
    same = sum(a == b for a, b in zip(tidal_tokens, static_tokens))
    print(
        f"ratio tidal/static: {ratio['requests_per_s']:.2f}x req/s, "
        f"{ratio['output_tokens_per_s']:.2f}x out tok/s, "
        f"{ratio['total_tokens_per_s']:.2f}x total tok/s, latency mean "
        f"{ratio['latency_mean_s']:.2f}x p99 {ratio['latency_p99_s']:.2f}x "
        f"| identical greedy outputs {same}/{len(work)}"
    )
    return {
        "mode": "throughput",
        **_environment(args, llm),
        "num_prompts": args.num_prompts,
        "batch_size": args.batch_size,
        "max_num_seqs": args.max_num_seqs,
        "workload": {
            "prompt_len": [args.min_prompt_len, args.max_prompt_len],
            "max_tokens": [args.min_tokens, args.max_tokens],
        },
        "tidal": asdict(tidal_summary),
        "static": asdict(static_summary),
        "ratio_tidal_over_static": ratio,
        "identical_outputs": same,
    }


def _decode_rate(llm, num_seqs: int, prompt_len: int, num_tokens: int, vocab: int) -> float:
    """Decode tokens/s of num_seqs sequences stepping together: every one is prefilled in the
    first step, then each of the num_tokens - 1 later steps yields one token per sequence."""
    work = make_workload(
        num_seqs, num_seqs, vocab, min_prompt_len=prompt_len, max_prompt_len=prompt_len,
        min_tokens=num_tokens, max_tokens=num_tokens,
    )  # fmt: skip
    outs = llm.generate(
        prompt_token_ids=[w.prompt_token_ids for w in work],
        sampling_params=_params(num_tokens),
    )
    first = max(o.metrics.first_token_time_s for o in outs)
    last = max(o.metrics.finished_time_s for o in outs)
    return num_seqs * (num_tokens - 1) / (last - first)


def _prefill_rate(llm, prompt_len: int, vocab: int) -> float:
    work = make_workload(1, 7, vocab, min_prompt_len=prompt_len, max_prompt_len=prompt_len)
    out = llm.generate(prompt_token_ids=[work[0].prompt_token_ids], sampling_params=_params(1))[0]
    return prompt_len / (out.metrics.first_token_time_s - out.metrics.arrival_time_s)


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """gpt-fast's figures: decode tok/s and the GB/s of weights that implies (every parameter is
    read once per step; the tied embedding once, as the LM head), plus prefill tok/s."""
    batches = args.decode_batches
    # Prefix caching off: warm-up and measured runs repeat prompts, and every token must compute.
    llm = _build_llm(args, max(args.max_num_seqs, *batches), enable_prefix_caching=False)
    loaded = llm.engine.loaded
    vocab = loaded.arch.vocab_size
    param_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    prompt_len, n = 16, args.decode_tokens
    _decode_rate(llm, max(batches), prompt_len, 4, vocab)  # warm-up, excluded
    _prefill_rate(llm, args.prefill_len, vocab)
    record: dict[str, Any] = {
        "mode": "decode",
        **_environment(args, llm),
        "param_bytes": param_bytes,
    }
    for b in batches:
        tok_s = _decode_rate(llm, b, prompt_len, n, vocab)
        gb_s = param_bytes * tok_s / b / 1e9  # steps/s * bytes per step
        record[f"decode_{b}"] = {"num_seqs": b, "tokens": n, "tok_s": tok_s, "weights_gb_s": gb_s}
        print(f"decode x{b:<3} {tok_s:8.1f} tok/s  {gb_s:6.2f} GB/s of weights", flush=True)
    prefill = _prefill_rate(llm, args.prefill_len, vocab)
    record["prefill"] = {"prompt_len": args.prefill_len, "tok_s": prefill}
    print(f"prefill {args.prefill_len} tokens {prefill:8.1f} tok/s", flush=True)
    # llama.cpp's figures are measured, not remembered: `tidal bench kernels` runs its tools.
    print("llama.cpp on this machine, file and threads: tidal bench kernels", flush=True)
    return record


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from tidal.config.hardware import HardwareConfig
    from tidal.config.model import DTYPES
    from tidal.config.scheduler import SchedulerConfig

    # Defaults come from the config dataclasses (slots: read them from an instance).
    hardware, scheduler = HardwareConfig(), SchedulerConfig()
    p = argparse.ArgumentParser(prog="python -m tidal.bench.offline", description=__doc__)
    p.add_argument("--mode", choices=("throughput", "decode"), default="throughput")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="the static baseline's batch size")
    p.add_argument("--dtype", choices=DTYPES, default=hardware.dtype)
    p.add_argument("--threads", type=int, default=hardware.threads)
    p.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64, help="decode mode: tokens per run")
    p.add_argument(
        "--decode-batches",
        type=_int_list,
        default=(1, 8, 32),
        help="decode mode: comma-separated numbers of sequences decoding together",
    )
    p.add_argument("--prefill-len", type=int, default=512, help="decode mode: prefill prompt")
    p.add_argument("--json", type=Path, default=None, help="write the record here")
    args = p.parse_args(argv)
    for name in ("num_prompts", "batch_size", "max_num_seqs", "decode_tokens", "prefill_len"):
        value = getattr(args, name)
        if value < 1:
            p.error(f"--{name.replace('_', '-')}={value} is invalid: expected an integer >= 1")
    if args.decode_tokens < 2:
        p.error(f"--decode-tokens={args.decode_tokens} is invalid: expected an integer >= 2")
    return args


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1, comma-separated")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = run_decode(args) if args.mode == "decode" else run_offline(args)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
