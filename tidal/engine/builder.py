"""build_engine: resolve device and dtype, load the model and tokenizer, make an EngineCore."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tidal.config.engine import EngineConfig
from tidal.engine.core import EngineCore
from tidal.engine.stats import StepStats

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
) -> EngineCore:
    from tidal.loader.model_loader import load_model
    from tidal.loader.tokenizer import load_tokenizer

    if config.hardware.threads is not None:
        torch.set_num_threads(config.hardware.threads)
    device = resolve_device(config)
    dtype = resolve_dtype(config.weight_dtype, device)
    path = model_path(config)
    if progress:
        progress(f"loading {path} ({dtype}, {device})")
    from concurrent.futures import ThreadPoolExecutor

    from tidal.loader.model_loader import read_arch

    family = read_arch(path)[0].family
    # The tokenizer (Rust, off the GIL) loads while torch dequantizes the weights.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_future = pool.submit(load_tokenizer, path, family)
        loaded = load_model(path, dtype, device)
        tokenizer = tokenizer_future.result()
    if config.model.quantization != "none":
        from tidal.quant.registry import quantize_model

        summary = quantize_model(loaded.model, config.model.quantization)
        if progress:
            progress(
                f"quantized {summary.num_linear} linear layers to {summary.scheme}: weights "
                f"{summary.weight_bytes_before / 1e6:.0f} MB -> {summary.weight_bytes_after / 1e6:.0f} MB"
            )
    return EngineCore(config, loaded, tokenizer, clock=clock, on_step=on_step)
