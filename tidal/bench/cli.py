"""`tidal bench run|compare|kernels|synth`: the benchmarks' command line."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from tidal.bench.run import LoadSpec, RunConfig, resolve_model, run_sweep
from tidal.bench.run_stats import SLO, RunStats
from tidal.bench.stream_client import RequestOptions, RequestRecord
from tidal.bench.trace import WORKLOADS, TraceRequest, WorkloadSpec, build_trace, parse_length


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` (with `run`, `compare`, `kernels` and `synth`) on the `tidal` command's
    subparsers."""
    parser = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible server, or compare tidal with baselines"
    )
    sub = parser.add_subparsers(dest="bench_command", required=True)
    run_p = sub.add_parser(
        "run", help="replay a seeded trace against a running server and report latency/throughput"
    )
    run_p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    run_p.add_argument("--model", default=None, help="model name to send (default: /v1/models)")
    run_p.add_argument("--api-key", default=None)
    run_p.add_argument(
        "--server-pid", type=int, default=None, help="sample this process tree's peak RSS"
    )
    add_trace_arguments(run_p)
    add_load_arguments(run_p)
    add_output_arguments(run_p, default_prefix="bench")
    run_p.set_defaults(func=run)

    from tidal.bench import compare

    cmp_p = sub.add_parser(
        "compare",
        help="start tidal, its ablations and the baselines one by one and replay one trace on each",
    )
    compare.add_arguments(cmp_p)
    add_trace_arguments(cmp_p, num_requests=compare.DEFAULT_NUM_REQUESTS, workload="chat")
    add_load_arguments(cmp_p, concurrency=str(compare.DEFAULT_CONCURRENCY))
    add_output_arguments(cmp_p, default_prefix="compare")
    # Small on purpose: six targets (one loads for minutes) in under 15 minutes on 2 CPU cores.
    cmp_p.set_defaults(func=compare.run, input_len="64", output_len="16", system_len=256, turns=2)

    from tidal.bench import kernels

    k_p = sub.add_parser(
        "kernels",
        help="tidal's engine against llama-bench and llama-batched-bench (pp512, tg128, 32 x tg128)",
    )
    kernels.add_arguments(k_p)
    k_p.set_defaults(func=kernels.run)

    from tidal.bench import synth

    s_p = sub.add_parser(
        "synth", help="write a layout twin: a real model's GGUF layout with synthetic weights"
    )
    synth.add_arguments(s_p)
    s_p.set_defaults(func=synth.run)
    return parser


def add_trace_arguments(
    p: argparse.ArgumentParser, num_requests: int = 64, workload: str = "fixed"
) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--workload", default=workload, choices=WORKLOADS, help=(
        "fixed/range: --input-len/--output-len words; mix: prompts of 512 and 1024; chat: "
        "multi-turn sessions carrying their history; long: prompts past 2048; system: a shared "
        "system prompt; jsonl: --jsonl FILE"))  # fmt: skip
    g.add_argument(
        "--input-len", default="128", help="prompt words, N or MIN-MAX (about one token each)"
    )
    g.add_argument("--output-len", default="32", help="max_tokens, N or MIN-MAX")
    g.add_argument("--turns", type=int, default=4, help="chat: turns per session")
    g.add_argument(
        "--system-len", type=int, default=256, help="chat/system: shared system-prompt words"
    )
    g.add_argument("--api", default="completions", choices=["completions", "chat"],
                   help="chat/system: send messages to /v1/chat/completions, or a transcript to /v1/completions")  # fmt: skip
    g.add_argument("--jsonl", default=None, help="jsonl: one {prompt|messages, max_tokens?} a line")
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--seed", type=int, default=0)


def add_load_arguments(p: argparse.ArgumentParser, concurrency: str | None = None) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default=None, help="open loop: req/s, a sweep '2,4,8', 'inf'")
    g.add_argument("--concurrency", default=concurrency, help="closed loop: requests in flight, or a sweep '1,4'")  # fmt: skip
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps (1: Poisson)")
    g.add_argument("--warmup", type=int, default=1, help="warm-up requests, not recorded")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: always generate max_tokens)")  # fmt: skip
    g.add_argument("--metrics-interval-s", type=float, default=0.5)
    g.add_argument("--no-progress", dest="progress", action="store_false")


def add_output_arguments(p: argparse.ArgumentParser, default_prefix: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write runs (and every request) as JSON here")
    g.add_argument("--markdown", default=None, help="write the results table here")
    g.add_argument("--plots", default=None, help="write PNG plots into this folder")
    g.add_argument("--plot-prefix", default=default_prefix)


def _numbers(text: str, field: str, cast: type) -> list:
    out = []
    for part in text.split(","):
        try:
            out.append(cast(part.strip()) if part.strip() not in ("inf", "Inf") else math.inf)
        except ValueError:
            raise ValueError(
                f"{field}={text!r} is invalid: expected numbers separated by commas"
            ) from None
    return out


def loads_from_args(args: argparse.Namespace) -> list[LoadSpec]:
    if (
        args.request_rate is not None
        and args.concurrency is not None
        and args.bench_command == "run"
    ):
        raise ValueError("--request-rate and --concurrency are exclusive: give one")
    if args.request_rate is not None:
        rates = _numbers(args.request_rate, "request_rate", float)
        return [LoadSpec(rate=r, burstiness=args.burstiness) for r in rates]
    if args.concurrency is None:
        raise ValueError(
            "no load given: expected --request-rate R[,R...] or --concurrency N[,N...]"
        )
    return [LoadSpec(concurrency=int(c)) for c in _numbers(args.concurrency, "concurrency", int)]


def traces_from_args(args: argparse.Namespace, num_loads: int) -> list[list[TraceRequest]]:
    """One trace per offered load, seeds --seed, --seed + 1, ...: the same prompts for every
    target, never the same prompts twice against one server."""
    return [trace_from_args(args, args.seed + i) for i in range(num_loads)]


def trace_from_args(args: argparse.Namespace, seed: int | None = None) -> list[TraceRequest]:
    spec = WorkloadSpec(
        name=args.workload,
        input_len=parse_length(args.input_len, "input_len"),
        output_len=parse_length(args.output_len, "output_len"),
        turns=args.turns,
        system_len=args.system_len,
        api=args.api,
        jsonl_path=args.jsonl,
    )
    return build_trace(spec, args.num_requests, args.seed if seed is None else seed)


def write_outputs(
    args: argparse.Namespace,
    runs: list[RunStats],
    records: list[list[RequestRecord]],
    meta: dict | None = None,
    notes: list[str] = (),
) -> str:
    """Table to stdout, and the JSON/Markdown/PNG files asked for. Returns the table."""
    from tidal.bench.report import markdown_table, write_json, write_markdown, write_plots

    table = markdown_table(runs) + "".join(f"\n{line}" for line in notes)
    print(table)
    if args.json:
        write_json(args.json, runs, records, meta)
    if args.markdown:
        write_markdown(args.markdown, table)
    if args.plots:
        for path in write_plots(args.plots, runs, args.plot_prefix):
            print(f"wrote {path}", file=sys.stderr)
    return table


def run(args: argparse.Namespace) -> int:
    """`tidal bench run`: one run per offered load against --base-url."""
    loads = loads_from_args(args)
    traces = traces_from_args(args, len(loads))
    model = args.model or asyncio.run(resolve_model(args.base_url, args.api_key))
    cfg = RunConfig(
        base_url=args.base_url,
        options=RequestOptions(model, args.temperature, args.ignore_eos, args.api_key),
        seed=args.seed,
        num_warmup=args.warmup,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        target=model,
        server_pid=args.server_pid,
        probe_interval_s=args.metrics_interval_s,
        progress=args.progress,
    )
    results = run_sweep(cfg, traces, loads)
    write_outputs(
        args, [s for s, _ in results], [r for _, r in results], {"workload": vars_of(args)}
    )
    return 0


def vars_of(args: argparse.Namespace) -> dict:
    """The arguments that define the trace and load, for the JSON record."""
    keys = ("workload", "input_len", "output_len", "turns", "system_len", "api", "jsonl",
            "num_requests", "seed", "request_rate", "concurrency", "burstiness", "warmup",
            "slo_ttft_ms", "slo_tpot_ms", "temperature", "ignore_eos", "target_tpot_ms")  # fmt: skip
    return {k: getattr(args, k, None) for k in keys}


def main(argv: list[str] | None = None) -> int:
    """`python -m tidal.bench.cli run ...` without the `tidal` front end."""
    parser = argparse.ArgumentParser(prog="tidal")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"tidal bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
