"""The accuracy gate: perplexity and next-token agreement of a quantized model against its float self."""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tidal.config.cache import KV_CACHE_DTYPES
from tidal.config.quant import NATIVE_SCHEMES, check_scheme
from tidal.quant.registry import QuantSummary, quantize_model

if TYPE_CHECKING:
    from tidal.loader.model_loader import LoadedModel

HELDOUT_PATH = Path(__file__).with_name("heldout.txt")
# Tokens fed to the model per forward pass inside one context chunk. 32 keeps every matmul on the
# few-row kernel path that decode and small batches take (tidal.quant.int8.KERNEL_MAX_ROWS), so the
# gate measures the numerics users get when generating, not only those of long prefills.
PIECE_TOKENS = 32
BLOCK_SIZE = 16


@dataclass(slots=True)
class TokenScores:
    nll: torch.Tensor  # (P,) float64: -log p(target) for every scored position
    argmax: torch.Tensor  # (P,) int64: the model's top-1 next token at each scored position


@dataclass(slots=True)
class GateReport:
    scheme: str
    num_tokens: int  # predictions scored
    context_tokens: int  # chunk length; each chunk starts a fresh sequence
    ppl_ref: float
    ppl_quant: float
    change_pct: float  # 100 * (ppl_quant / ppl_ref - 1)
    top1_agreement: float  # fraction of positions where both models' argmax agree
    threshold_pct: float
    passed: bool  # change_pct <= threshold_pct
    summary: QuantSummary | None = None

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict} {self.scheme}: ppl {self.ppl_ref:.4f} -> {self.ppl_quant:.4f} "
            f"({self.change_pct:+.3f}%, limit +{self.threshold_pct}%), "
            f"top-1 agreement {100 * self.top1_agreement:.2f}% over {self.num_tokens} tokens"
        )


class GateFailed(ValueError):
    """Perplexity rose more than the threshold and the caller did not force the scheme.

    A ValueError: like any other setting the engine cannot honour, `tidal serve` reports it and
    exits 2 rather than printing a traceback."""


def heldout_text(path: Path = HELDOUT_PATH) -> str:
    """The held-out prose, without its '#' header lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith("#")).strip() + "\n"


def perplexity(nll: torch.Tensor) -> float:
    """exp(mean negative log-likelihood)."""
    if nll.numel() == 0:
        raise ValueError("perplexity needs at least one scored token, got none")
    return math.exp(nll.double().mean().item())


def score_tokens(
    loaded: LoadedModel,
    ids: list[int],
    context_tokens: int,
    piece_tokens: int = PIECE_TOKENS,
    kv_cache_dtype: str = "auto",
) -> TokenScores:
    """Split `ids` into chunks of `context_tokens`, run each as its own sequence through the
    engine's model runner, and score every position's prediction of the next token inside its chunk.

    Each chunk is one request whose prompt is the chunk; it is prefilled `piece_tokens` at a time,
    as chunked prefill does, asking the runner for its prompt logprobs (top-1 included), through a
    paged KV pool stored as `kv_cache_dtype`, so later pieces read earlier ones' keys and values
    back from the cache as serving does (an 8-bit cache changes these scores)."""
    # Lazy: `tidal --help` imports this module for its quantize-check parser.
    from tidal.kv.layout import KVLayout
    from tidal.request import Request
    from tidal.sampling_params import SamplingParams
    from tidal.scheduler.output import ScheduledRequest, SchedulerOutput
    from tidal.worker.model_runner import ModelRunner

    if context_tokens < 2:
        raise ValueError(f"context_tokens={context_tokens} is invalid: expected >= 2")
    if piece_tokens < 1:
        raise ValueError(f"piece_tokens={piece_tokens} is invalid: expected >= 1")
    arch = loaded.arch
    kv_dtype = _float_dtype(loaded.model)
    layout = KVLayout.from_layer_windows(
        arch.layer_windows(),
        block_size=BLOCK_SIZE,
        num_kv_heads=arch.kv_cache_heads,
        head_dim=arch.kv_cache_head_dim,
        parts=arch.kv_cache_parts,
        dtype_bytes=kv_dtype.itemsize,
        kv_dtype=kv_cache_dtype,
    )
    blocks = -(-context_tokens // BLOCK_SIZE)
    num_groups = len(layout.groups)
    # Block 0 is the null block; group g owns blocks 1 + g * blocks .. (contiguous). Every chunk
    # reuses them: a chunk starts a fresh sequence, and it only reads positions it has written.
    tables = [[1 + g * blocks + b for b in range(blocks)] for g in range(num_groups)]
    runner = ModelRunner(loaded, layout, 1 + num_groups * blocks, kv_dtype)
    # One alternative per position: the runner's top-1 is the model's argmax next token.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    nlls: list[float] = []
    tops: list[int] = []
    for start in range(0, len(ids) - 1, context_tokens):
        chunk = ids[start : start + context_tokens]
        if len(chunk) < 2:
            break
        req = Request(f"gate-{start}", chunk, params, arrival_time_s=0.0)
        for p in range(0, len(chunk) - 1, piece_tokens):
            n = min(piece_tokens, len(chunk) - p)
            piece = ScheduledRequest(req, p, n, tables, sample=False, want_prompt_logprobs=True)
            out = runner.execute(SchedulerOutput([piece], n, n))
            for _, lp in out.prompt_logprobs[req.request_id]:
                nlls.append(-lp.logprob)
                tops.append(lp.top_ids[0])
    return TokenScores(
        torch.tensor(nlls, dtype=torch.float64), torch.tensor(tops, dtype=torch.int64)
    )


def _float_dtype(model: nn.Module) -> torch.dtype:
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and t.dtype.itemsize >= 2:
            return t.dtype
    return torch.float32


def compare(
    ref: TokenScores, quant: TokenScores, scheme: str, context_tokens: int, threshold_pct: float
) -> GateReport:
    """The gate's arithmetic on two models' scores over the same tokens."""
    if ref.nll.shape != quant.nll.shape:
        raise ValueError(f"scores cover {ref.nll.numel()} vs {quant.nll.numel()} tokens")
    ppl_ref, ppl_quant = perplexity(ref.nll), perplexity(quant.nll)
    change = 100.0 * (ppl_quant / ppl_ref - 1.0)
    agree = (ref.argmax == quant.argmax).double().mean().item()
    return GateReport(
        scheme,
        ref.nll.numel(),
        context_tokens,
        ppl_ref,
        ppl_quant,
        change,
        agree,
        threshold_pct,
        change <= threshold_pct,
    )


def mode_name(scheme: str, kv_cache_dtype: str) -> str:
    """How a report names what it measured: "int8", "kv-fp8", "int4+kv-int8"."""
    parts = ([scheme] if scheme != "none" else []) + (
        [f"kv-{kv_cache_dtype}"] if kv_cache_dtype != "auto" else []
    )
    return "+".join(parts) or "none"


def run_gate(
    model_path: str | Path | None,
    scheme: str,
    threshold_pct: float = 1.0,
    context_tokens: int | None = None,
    max_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    weight_cache: bool = True,
) -> GateReport:
    """Score the held-out text with the float model and float KV cache, quantize the weights in
    place (scheme "none" leaves them) and score again through a `kv_cache_dtype` KV cache. For
    the GGUF-block schemes the reference is the file's blocks with float activations.

    `model_path` None means the bundled model; `context_tokens` None takes min(the model's context,
    4096); `max_tokens` truncates the held-out text (tests, quick checks); `weight_cache` is
    model.weight_cache (false: the float load writes no cache file beside a GGUF)."""
    from tidal.loader.model_loader import load_model
    from tidal.loader.tokenizer import load_tokenizer
    from tidal.quant.gguf_blocks import set_activations

    check_scheme(scheme)
    if scheme == "gguf-q8":
        from tidal.quant.gguf_blocks import native_scheme

        # Without tidal's C kernels int8 activations cannot run: refused, as the engine does,
        # rather than scoring float activations under gguf-q8's name (and caching that verdict).
        native_scheme(scheme, scheme)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is invalid: expected one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    if not threshold_pct >= 0:
        raise ValueError(f"threshold_pct={threshold_pct!r} is invalid: expected a number >= 0")
    if model_path is None:
        from tidal.loader.bundled import bundled_model_path

        model_path = bundled_model_path()
    native = scheme in NATIVE_SCHEMES
    # The file's own blocks: one load, scored first with float activations (the dequantized
    # model up to summation order, no float copy of the weights) as the reference.
    loaded = load_model(model_path, gguf_blocks=native, weight_cache=weight_cache)
    if native:
        set_activations(loaded.model, "f32")
    ids = load_tokenizer(model_path, loaded.arch.family).encode(heldout_text())
    if max_tokens is not None:
        ids = ids[:max_tokens]
    context = context_tokens or min(loaded.arch.max_position_embeddings, 4096)
    ref = score_tokens(loaded, ids, context)
    summary = quantize_model(loaded.model, scheme) if scheme != "none" else None
    quant = score_tokens(loaded, ids, context, kv_cache_dtype=kv_cache_dtype)
    report = compare(ref, quant, mode_name(scheme, kv_cache_dtype), context, threshold_pct)
    report.summary = summary
    return report


def enforce(report: GateReport, force: bool = False) -> None:
    """Raise GateFailed when the report failed, unless forced."""
    if not report.passed and not force:
        raise GateFailed(report.line() + " (pass --force to use it anyway)")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quantization == "none" and args.kv_cache_dtype in ("auto", "float32"):
        raise ValueError(
            "quantize-check needs --quantization gguf|gguf-q8|int8|int4|fp8 or --kv-cache-dtype "
            "float16|bfloat16|int8|fp8: "
            "with neither there is nothing to compare against the float model"
        )
    start = time.perf_counter()
    report = run_gate(
        args.model,
        args.quantization,
        args.threshold_pct,
        args.context_tokens,
        args.max_tokens,
        args.kv_cache_dtype,
    )
    print(report.line())
    if report.summary is not None:
        s = report.summary
        print(
            f"weights: {s.weight_bytes_before / 1e6:.1f} MB -> {s.weight_bytes_after / 1e6:.1f} MB"
        )
    gate_s = time.perf_counter() - start
    print(f"took {gate_s:.1f} s")
    if args.context_tokens is None:
        # The verdict a start-up with these settings would measure: store it, so `tidal serve`
        # after a `quantize-check` starts without measuring again.
        from tidal.worker.gate_cache import save_verdict, verdict_key, verdict_of

        path = Path(args.model) if args.model else _bundled()
        key = verdict_key(
            path,
            args.quantization,
            args.kv_cache_dtype,
            args.threshold_pct,
            heldout_text(),
            args.max_tokens,
        )
        save_verdict(path, key, verdict_of(report, gate_s))
    try:
        enforce(report, args.force)
    except GateFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _bundled() -> Path:
    from tidal.loader.bundled import bundled_model_path

    return bundled_model_path()


def main(argv: list[str] | None = None) -> int:
    from tidal.worker.gate_args import add_parser

    parser = argparse.ArgumentParser(prog="tidal")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["quantize-check", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
