"""ModelConfig: which checkpoint to serve, under what name, and its context and weight dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from tidal.config._check import check
from tidal.config.quant import SCHEMES as QUANTIZATIONS

# The dtypes a user may name; "auto" is resolved by the engine once the device is known.
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # A GGUF file, a safetensors directory, or None for the bundled default model.
    path: str | None = None
    # The dtype weights are held in after loading/dequantizing; "auto" follows hardware.dtype
    # (the compute dtype), so one `--dtype` sets both unless the weights need to differ.
    dtype: str = "auto"
    # Context limit (prompt + output); None takes the checkpoint's own limit.
    max_model_len: int | None = None
    # The name /v1/models lists and requests must use; None derives it from `path`.
    served_model_name: str | None = None
    # Weight format (tidal.quant.registry): "auto" runs a GGUF file's own blocks with int8
    # activations on CPU ("gguf-q8") and float weights otherwise ("none"); "gguf" keeps float32
    # activations (the file's model up to summation order); "int8", "int4", "fp8" re-quantize
    # float weights (gated).
    quantization: str = "auto"
    # Save a GGUF's dequantized weights beside it (~4 bytes per parameter in float32: ~1.1 GB for
    # the bundled 270M model) so a restarted engine memory-maps them instead of dequantizing.
    weight_cache: bool = True
    # GGUF blocks on a CPU: a matrix of 32 MiB or more (the LM head) moves into transparent huge
    # pages once the engine is ready (tidal/loader/resident.py): faster decode, but the pages are
    # the process's own, where the file's mapping is shared by every process on the same file.
    huge_pages: bool = True

    def __post_init__(self) -> None:
        check(
            self.path is None or (isinstance(self.path, str) and self.path != ""),
            "path",
            self.path,
            "a non-empty path or None",
        )
        check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        check(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            self.max_model_len,
            "an integer >= 1 or None",
        )
        check(
            self.served_model_name is None or self.served_model_name.strip() != "",
            "served_model_name",
            self.served_model_name,
            "a non-empty name or None",
        )
        check(
            isinstance(self.weight_cache, bool),
            "weight_cache",
            self.weight_cache,
            "true or false",
        )
        check(
            isinstance(self.huge_pages, bool),
            "huge_pages",
            self.huge_pages,
            "true or false",
        )
        check(
            self.quantization in QUANTIZATIONS,
            "quantization",
            self.quantization,
            f"one of {', '.join(QUANTIZATIONS)}",
        )

    def served_name(self, bundled_name: str) -> str:
        """The public model id: `served_model_name`, else the checkpoint's file or folder stem."""
        if self.served_model_name is not None:
            return self.served_model_name
        if self.path is None:
            return bundled_name
        # "/m/gemma-3-270m.gguf" -> "gemma-3-270m"; "/m/Qwen2-0.5B/" -> "Qwen2-0.5B".
        p = PurePath(self.path.rstrip("/\\"))
        return p.stem if p.suffix.lower() in (".gguf", ".safetensors") else p.name
