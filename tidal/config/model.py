"""ModelConfig: which checkpoint to serve, under what name, and its context and weight dtype."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import PurePath

from tidal.config._check import check
from tidal.config.quant import SCHEMES as QUANTIZATIONS

# The dtypes a user may name; "auto" is resolved by the engine once the device is known.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The sampling settings a checkpoint may recommend, by their generation_config.json names (vLLM's
# --override-generation-config takes the same); max_new_tokens is a request's max_tokens.
GENERATION_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


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
    # Defaults for the sampling fields a request leaves unset (tidal/loader/generation_config.py):
    # "auto" takes the checkpoint's recommendation (generation_config.json, a GGUF's
    # general.sampling.* keys), as vLLM and llama.cpp do; "none" keeps OpenAI's defaults; else a
    # folder holding a generation_config.json (or that file).
    generation_config: str = "auto"
    # A JSON object of GENERATION_FIELDS laid over those defaults: '{"temperature": 0.6}'.
    override_generation_config: str | None = None

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

        check(
            isinstance(self.generation_config, str) and self.generation_config.strip() != "",
            "generation_config",
            self.generation_config,
            "auto, none, or a folder holding generation_config.json",
        )
        if isinstance(self.override_generation_config, dict):  # LLM(...) and YAML give a mapping
            object.__setattr__(
                self, "override_generation_config", json.dumps(self.override_generation_config)
            )
        self.generation_overrides()  # raises on a bad one

    def generation_overrides(self) -> dict[str, float]:
        """`override_generation_config` as a dict (empty when unset); ValueError naming the key."""
        text = self.override_generation_config
        if text is None:
            return {}
        name = "override_generation_config"
        try:
            value = json.loads(text) if isinstance(text, str) else None
        except json.JSONDecodeError:
            value = None
        check(isinstance(value, dict), name, text, 'a JSON object such as {"temperature": 0.6}')
        for field, number in value.items():
            check(field in GENERATION_FIELDS, name, text,
                  f"keys among {', '.join(GENERATION_FIELDS)} (got {field!r})")  # fmt: skip
            ok = isinstance(number, int | float) and not isinstance(number, bool)
            check(ok and math.isfinite(number), name, text,
                  f"a number for {field!r} (got {number!r})")  # fmt: skip
        return value

    def served_name(self, bundled_name: str) -> str:
        """The public model id: `served_model_name`, else the checkpoint's file or folder stem."""
        if self.served_model_name is not None:
            return self.served_model_name
        if self.path is None:
            return bundled_name
        # "/m/gemma-3-270m.gguf" -> "gemma-3-270m"; "/m/Qwen2-0.5B/" -> "Qwen2-0.5B".
        p = PurePath(self.path.rstrip("/\\"))
        return p.stem if p.suffix.lower() in (".gguf", ".safetensors") else p.name
