"""The `tidal` command: generate, chat, serve."""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def loading_progress(what: str) -> Iterator[None]:
    """A spinner with elapsed seconds on a terminal; one line when stderr is not a terminal."""
    start = time.perf_counter()
    done = threading.Event()
    tty = sys.stderr.isatty()

    def spin() -> None:
        for ch in itertools.cycle("|/-\\"):
            if done.wait(0.1):
                return
            sys.stderr.write(f"\r{ch} {what} {time.perf_counter() - start:5.1f}s")
            sys.stderr.flush()

    thread = threading.Thread(target=spin, daemon=True) if tty else None
    if thread:
        thread.start()
    else:
        print(f"{what} ...", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        done.set()
        if thread:
            thread.join()
        end = "\r" if tty else ""
        print(
            f"{end}{what}: done in {time.perf_counter() - start:.1f}s   ",
            file=sys.stderr,
            flush=True,
        )


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF directory (default: the bundled Gemma 3 270M)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    from tidal.config.cache import KV_CACHE_DTYPES
    from tidal.config.quant import SCHEMES

    p.add_argument(
        "--quantization",
        default="auto",
        choices=SCHEMES,
        help="weight format (auto: a GGUF file's own blocks on CPU, else float)",
    )
    _gate_args(p, KV_CACHE_DTYPES, default_kv="auto")


def _gate_args(
    p: argparse.ArgumentParser, kv_dtypes: tuple[str, ...], default_kv: str | None
) -> None:
    taken = p._option_string_actions  # NOTE: skips flags the config loader already registers
    if "--kv-cache-dtype" not in taken:
        p.add_argument(
            "--kv-cache-dtype",
            default=default_kv,
            choices=kv_dtypes,
            help="KV cache storage (8-bit: ~2x tokens)",
        )
    if "--quantization-gate" not in taken:
        p.add_argument(
            "--quantization-gate",
            default=None,
            action=argparse.BooleanOptionalAction,
            help="measure perplexity vs float before serving a quantized mode (default: on)",
        )
    if "--force-quantization" not in taken:
        p.add_argument(
            "--force-quantization",
            default=None,
            action="store_true",
            help="serve even if the gate fails",
        )


# What generate and chat sample with where neither a flag nor the model's recommendation
# (generation_config.json, a GGUF's general.sampling.*) says otherwise: greedy, 128 tokens.
_CLI_SAMPLING = {"temperature": 0.0, "max_tokens": 128}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    model = "default: the model's recommendation, else"
    p.add_argument("--max-tokens", type=int, default=None, help=f"{model} 128")
    p.add_argument("--temperature", type=float, default=None, help=f"0 is greedy ({model} 0)")
    p.add_argument("--top-p", type=float, default=None, help=f"{model} 1")
    p.add_argument("--top-k", type=int, default=None, help=f"{model} 0 (off)")
    p.add_argument("--seed", type=int, default=None)


def _build(args: argparse.Namespace) -> Any:
    from tidal.engine.llm import engine_config_from_kwargs

    gate = {
        name: value
        for name, value in (
            ("kv_cache_dtype", args.kv_cache_dtype),
            ("quantization_gate", args.quantization_gate),
            ("force_quantization", args.force_quantization),
        )
        if value is not None
    }
    config = engine_config_from_kwargs(
        args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        quantization=args.quantization,
        **gate,
    )
    from tidal.engine.builder import build_engine

    with loading_progress(f"loading {args.model or 'the bundled Gemma 3 270M'}"):
        return build_engine(config)


def _params(args: argparse.Namespace, engine: Any) -> Any:
    """The flags given, over the model's recommended sampling, over greedy 128 tokens."""
    from tidal.config.model import ModelConfig
    from tidal.loader.generation_config import sampling_defaults
    from tidal.sampling_params import SamplingParams

    recommended, source = sampling_defaults(ModelConfig(), engine.loaded.path)
    flags = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    taken = {k: v for k, v in recommended.items() if k not in given}
    if taken:
        shown = ", ".join(f"{k}={v:g}" for k, v in taken.items())
        print(f"sampling with the model's {shown} (from {source})", file=sys.stderr)
    return SamplingParams(**{**_CLI_SAMPLING, **taken, **given})


def _stream(
    engine: Any, request_id: str, token_ids: list[int], params: Any, session_id: str | None = None
) -> str:
    """Run one request to completion, printing text as it is produced; returns the full text."""
    engine.add_request(request_id, token_ids, params, delta=True, session_id=session_id)
    text = []
    start, first, n = time.perf_counter(), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            chunk = out.outputs[0]
            if chunk.token_ids and first is None:
                first = time.perf_counter()
            n += len(chunk.token_ids)
            text.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    end = time.perf_counter()
    decode_s = end - (first or end)
    rate = f", {(n - 1) / decode_s:.1f} tok/s decode" if n > 1 and decode_s > 0 else ""
    print(f"\n[{n} tokens, first after {((first or end) - start):.2f}s{rate}]", file=sys.stderr)
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _build(args)
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True
        )
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    if not args.chat:
        sys.stdout.write(args.prompt)
    _stream(engine, "generate-0", ids, _params(args, engine))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _build(args)
    tok = engine.tokenizer
    params = _params(args, engine)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    for turn in itertools.count():
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        reply = _stream(
            engine,
            f"chat-{turn}",
            tok.encode(prompt, add_special_tokens=False),
            params,
            "chat",
        )
        messages.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="An LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a prompt, streaming to the terminal")
    gen.add_argument("prompt")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="a system prompt")
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)

    try:
        from tidal import cli_serve
    except ImportError:  # the server extra is not installed
        cli_serve = None  # type: ignore[assignment]
    if cli_serve is not None and hasattr(cli_serve, "add_parser"):
        cli_serve.add_parser(sub)  # the gate flags come from the config loader's flag table
    try:
        from tidal.bench import cli as cli_bench
    except ImportError:  # aiohttp (dev extra) is imported lazily; this guards the rest
        cli_bench = None  # type: ignore[assignment]
    if cli_bench is not None:
        cli_bench.add_parser(sub)
    from tidal.worker import gate_args

    gate_args.add_parser(sub)  # `tidal quantize-check --quantization int8`; torch-free
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
