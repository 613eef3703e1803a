"""Quantization scheme names and how "auto" resolves: the settings side of tidal.quant (torch-free)."""

from __future__ import annotations

# Weight-only schemes applied as a module swap after loading (tidal.quant.int8/int4/fp8).
WEIGHT_SCHEMES = ("int8", "int4", "fp8")
# Load-time schemes: a GGUF file's own blocks (tidal.quant.gguf_blocks), read by tidal's kernels
# with float32 activations ("gguf": the same model up to summation order) or int8 ones with a
# scale per 32 values ("gguf-q8", as llama.cpp multiplies on CPU: +0.017% perplexity on the
# bundled model's held-out text, top-1 agreement 96.75%; docs/quantization.md).
NATIVE_SCHEMES = ("gguf", "gguf-q8")
# "auto": the file's blocks with int8 activations for a GGUF checkpoint on CPU (the fastest at
# every batch size), float weights otherwise.
SCHEMES = ("auto", "none", *NATIVE_SCHEMES, *WEIGHT_SCHEMES)


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(
            f"quantization={scheme!r} is invalid: expected one of {', '.join(SCHEMES)}"
        )
    return scheme


def resolve_scheme(scheme: str, is_gguf_file: bool, device_type: str) -> str:
    """The scheme "auto" stands for here; a GGUF scheme on a checkpoint without blocks is refused."""
    check_scheme(scheme)
    if scheme == "auto":
        return "gguf-q8" if is_gguf_file and device_type == "cpu" else "none"
    if scheme in NATIVE_SCHEMES and not (is_gguf_file and device_type == "cpu"):
        where = f"device {device_type}" if is_gguf_file else "a checkpoint that is not a GGUF file"
        raise ValueError(
            f"quantization={scheme!r} is invalid for {where}: it runs a GGUF file's own blocks "
            "on CPU; expected one of none, int8, int4, fp8"
        )
    return scheme


# Schemes the start-up gate need not measure: the float model, and the file's blocks with float or
# int8 activations (the int8 rounding of activations moved perplexity by +0.017% on the bundled
# model, far inside the gate's 1%; `tidal quantize-check --quantization gguf-q8` measures any file).
UNGATED_SCHEMES = ("auto", "none", "gguf", "gguf-q8")


def gate_needed(scheme: str) -> bool:
    """Whether a scheme changes the model's numbers enough that the accuracy gate must pass first."""
    return scheme not in UNGATED_SCHEMES
