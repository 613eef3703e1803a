"""build_engine: resolve device and dtype, gate quantized modes, load the model, make an EngineCore."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from tidal.config.cache import UNGATED_KV_DTYPES, resolve_kv_dtype
from tidal.config.engine import EngineConfig
from tidal.config.quant import NATIVE_SCHEMES, gate_needed, resolve_scheme
from tidal.engine.core import EngineCore
from tidal.engine.stats import StepStats
from tidal.loader.heap import release_free_heap
from tidal.quant.gguf_blocks import native_scheme

log = logging.getLogger("tidal.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    device = torch.device(config.hardware.resolve_device(torch.cuda.is_available()))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"hardware.device={config.hardware.device!r} is invalid: no CUDA device is available"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is float32 on CPU (measured faster than bfloat16 on CPUs without bf16 matmul
    units, see README) and bfloat16 on GPUs that support it, float16 otherwise."""
    if name != "auto":
        if name == "float16" and device.type == "cpu":
            raise ValueError("dtype='float16' is invalid on CPU: expected float32 or bfloat16")
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def model_path(config: EngineConfig) -> str:
    if config.model.path is not None:
        return config.model.path
    from tidal.loader.bundled import bundled_model_path

    return str(bundled_model_path())


def build_engine(
    config: EngineConfig,
    clock: Callable[[], float] = time.monotonic,
    on_step: Callable[[StepStats], None] | None = None,
    progress: Callable[[str], None] | None = None,
    on_group_lost: Callable[[str], None] | None = None,
    decode_only: bool = False,
    huge_pages_later: bool = False,
) -> EngineCore:
    """`on_group_lost(reason)` is called (on a watcher thread) when a tensor-parallel rank is
    lost; the engine process exits there, so the supervisor restarts the whole group.

    `decode_only`: the caller never encodes text with `core.tokenizer` (the engine process of
    `tidal serve`, whose API process tokenizes), so it may hold a decode-only tokenizer
    (tidal.loader.token_decoder: 3.4 MB instead of ~95 MB for Gemma 3's 262k vocabulary).

    Large GGUF block tensors (the LM head) start as mappings of the file and move into huge
    pages on a low-priority thread (tidal/loader/resident.py) that starts here, or, with
    `huge_pages_later`, when the caller calls `promote_in_background()` (the engine process:
    after it reports ready, so the move is not on the restart's path)."""
    from tidal.loader.model_loader import load_model
    from tidal.loader.resident import promote_in_background
    from tidal.loader.token_decoder import load_token_decoder
    from tidal.loader.tokenizer import load_tokenizer

    if config.hardware.data_parallel != 1:
        # One EngineCore is one replica; `tidal serve` runs N of them (router/replica_config.py
        # hands each data_parallel=1).
        raise ValueError(
            f"hardware.data_parallel={config.hardware.data_parallel} is invalid here: one engine "
            "is built in this process; data parallel needs `tidal serve --data-parallel N` "
            "(N engine processes behind its router)"
        )
    tp = config.hardware.tensor_parallel
    if config.hardware.threads is not None and tp == 1:
        torch.set_num_threads(config.hardware.threads)
    device = resolve_device(config)
    dtype = resolve_dtype(config.weight_dtype, device)
    path = model_path(config)
    scheme = resolve_scheme(config.model.quantization, not Path(path).is_dir(), device.type)
    resolved, scheme = scheme, native_scheme(scheme, config.model.quantization)
    if scheme != resolved:
        log.info(
            "tidal's C kernels did not build: serving the GGUF's blocks with float activations"
        )
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, scheme)
    if kv_dtype != config.cache.kv_cache_dtype:
        config = replace(config, cache=replace(config.cache, kv_cache_dtype=kv_dtype))
    # Before loading: a refused mode fails in seconds (cached verdict) without holding two models.
    check_quantization(config, path, progress, scheme)
    if progress:
        progress(f"loading {path} ({dtype}, {device})")
    from concurrent.futures import ThreadPoolExecutor

    from tidal.loader.model_loader import read_arch
    from tidal.models.registry import check_tensor_parallel

    arch = read_arch(path)[0]
    check_tensor_parallel(arch, tp)
    group = None
    if tp > 1:
        from tidal.loader.shard import ShardPlan

        ShardPlan(arch, 0, tp)  # a degree the model cannot split fails before any rank starts
        group = _start_group(config, path, dtype, device, scheme, on_group_lost)
        if progress:
            progress(
                f"tensor parallel: {tp} ranks ({config.hardware.distributed_executor_backend})"
            )
    try:
        # The tokenizer (Rust, off the GIL) loads while torch dequantizes the weights.
        with ThreadPoolExecutor(max_workers=1) as pool:
            load = load_token_decoder if decode_only else load_tokenizer
            tokenizer_future = pool.submit(load, path, arch.family)
            if group is not None:
                loaded = group.load()  # this rank's shard, quantized and wrapped
            else:
                loaded = load_model(
                    path,
                    dtype,
                    device,
                    weight_cache=config.model.weight_cache,
                    gguf_blocks=scheme in NATIVE_SCHEMES,
                    huge_pages=config.model.huge_pages,
                )
            tokenizer = tokenizer_future.result()
        if group is not None:
            core = EngineCore(
                config, loaded, tokenizer, clock=clock, on_step=on_step,
                make_executor=group.executor,
            )  # fmt: skip
            if progress:
                progress(
                    f"KV cache: {core.num_blocks} blocks of {core.layout.page_bytes} bytes per rank"
                )
            return core
    except BaseException:
        if group is not None:
            group.shutdown()
        raise
    if scheme not in ("none", "gguf"):
        from tidal.quant.registry import quantize_model

        summary = quantize_model(loaded.model, scheme)
        if progress:
            progress(
                f"quantized {summary.num_linear} linear layers to {summary.scheme}: weights "
                f"{summary.weight_bytes_before / 1e6:.0f} MB -> {summary.weight_bytes_after / 1e6:.0f} MB"
            )
    core = EngineCore(config, loaded, tokenizer, clock=clock, on_step=on_step)
    if progress:
        progress(f"KV cache: {core.num_blocks} blocks of {core.layout.page_bytes} bytes")
    release_free_heap()  # loading's scratch (GGUF metadata, weight conversion) is free by now
    if not huge_pages_later:
        promote_in_background()
    return core


def _start_group(
    config: EngineConfig,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    scheme: str,
    on_lost: Callable[[str], None] | None,
):
    """Start ranks 1..N-1 and join them as rank 0 (tidal.executor)."""
    from tidal.executor.rank import RankSpec, threads_per_rank

    hw = config.hardware
    if device.type == "cuda" and torch.cuda.device_count() < hw.tensor_parallel:
        raise ValueError(
            f"hardware.tensor_parallel={hw.tensor_parallel} is invalid: only "
            f"{torch.cuda.device_count()} CUDA devices are visible (one per rank)"
        )
    spec = RankSpec(
        path=path,
        dtype=str(dtype).removeprefix("torch."),
        device=device.type,
        scheme=scheme,
        rank=0,
        world_size=hw.tensor_parallel,
        master_port=0,
        threads=threads_per_rank(hw.threads, hw.tensor_parallel),
        collective_timeout_s=float(hw.collective_timeout_s),
        huge_pages=config.model.huge_pages,
    )
    if hw.distributed_executor_backend == "ray":
        from tidal.executor.ray_group import RayGroup

        return RayGroup(spec, on_lost)
    from tidal.executor.mp import LocalProcessGroup

    return LocalProcessGroup(spec, on_lost)


def check_quantization(
    config: EngineConfig,
    path: str,
    progress: Callable[[str], None] | None,
    scheme: str,
) -> None:
    """The start-up accuracy gate: when `scheme` (model.quantization, resolved) changes numbers or
    memory.kv_cache_dtype asks for fewer bits, measure perplexity against the float model
    (tidal.worker.gate) or reuse the verdict stored beside the model, log it, and raise GateFailed (a ValueError) when it fails, unless
    memory.force_quantization. memory.quantization_gate false skips all of it."""
    from tidal.worker.gate import GateFailed, heldout_text, mode_name, run_gate
    from tidal.worker.gate_cache import load_verdict, save_verdict, verdict_key, verdict_of

    kv_dtype = config.cache.kv_cache_dtype
    if not gate_needed(scheme) and kv_dtype in UNGATED_KV_DTYPES:
        return
    say = progress or log.info
    mode = mode_name(scheme, kv_dtype)
    cache = config.cache
    if not cache.quantization_gate:
        say(
            f"quantization gate disabled (memory.quantization_gate false): serving {mode} unchecked"
        )
        return
    threshold = cache.quantization_gate_threshold_pct
    max_tokens = cache.quantization_gate_max_tokens
    key = verdict_key(Path(path), scheme, kv_dtype, threshold, heldout_text(), max_tokens)
    verdict = load_verdict(Path(path), key)
    if verdict is not None:
        say(f"quantization gate (cached, measured in {verdict.gate_s:.0f} s): {verdict.line()}")
    else:
        say(f"quantization gate: measuring {mode} against float on the held-out text")
        start = time.perf_counter()
        report = run_gate(
            path,
            scheme,
            threshold,
            max_tokens=max_tokens,
            kv_cache_dtype=kv_dtype,
            weight_cache=config.model.weight_cache,
        )
        verdict = verdict_of(report, time.perf_counter() - start)
        save_verdict(Path(path), key, verdict)
        say(f"quantization gate ({verdict.gate_s:.0f} s): {verdict.line()}")
    if verdict.passed:
        return
    if cache.force_quantization:
        log.warning(
            "serving %s despite a failed gate (memory.force_quantization): %s", mode, verdict.line()
        )
        return
    raise GateFailed(
        f"refusing to serve {mode}: {verdict.line()}. Use a lighter mode, raise "
        "memory.quantization_gate_threshold_pct, or pass --force-quantization to serve it anyway"
    )
