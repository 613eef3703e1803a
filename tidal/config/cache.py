"""CacheConfig: the paged KV cache's size and prefix-reuse policy."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config._check import check
from tidal.config.quant import NATIVE_SCHEMES

# The KV cache's storage choices: "auto" is float16 pages where the weights are a GGUF file's own
# blocks (the CPU default for a GGUF, as llama.cpp's default KV type), else the model's float
# dtype (see resolve_kv_dtype); "float32" keeps float pages under any compute dtype; "float16"
# and "bfloat16" store 16-bit pages whatever the compute dtype (half of float32's bytes; keys and
# values are rounded to nearest even when written, float16 saturating at +-65504, and widen
# exactly when read); the 8-bit ones store one byte per element plus one float32 scale per
# (token, KV head), see tidal.attention.kv_quant.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8")
# The 8-bit ones, stored as codes and scales rather than a float tensor.
QUANTIZED_KV_DTYPES = ("int8", "fp8")
# Storage the accuracy gate need not measure: float pages, and float16's 11 significant bits
# (relative rounding 2^-11 against GGUF weights' ~1e-2 and bfloat16's 2^-8; docs/quantization.md).
UNGATED_KV_DTYPES = ("auto", "float32", "float16")


def resolve_kv_dtype(kv_dtype: str, weight_scheme: str) -> str:
    """The storage `kv_dtype` stands for under the resolved weight scheme: "auto" over a GGUF's
    own blocks ("gguf", "gguf-q8") is "float16"; anything else is returned as it is."""
    if kv_dtype == "auto" and weight_scheme in NATIVE_SCHEMES:
        return "float16"
    return kv_dtype


@dataclass(frozen=True, slots=True)
class CacheConfig:
    # Tokens per KV block (page).
    block_size: int = 16
    # KV pool size in bytes; None sizes it from `kv_cache_tokens` or `memory_fraction`.
    kv_cache_bytes: int | None = None
    # KV pool size in tokens (llama.cpp's -c, without --swa-full): enough pages that this many
    # tokens, over up to max_num_seqs sequences, always fit. Full-attention layers get a page for
    # every token; sliding-window layers only what their windows and one step's chunks can hold
    # at once (tidal.kv.block_pool.sliding_window_blocks), when that is less. Cannot be set
    # together with kv_cache_bytes.
    kv_cache_tokens: int | None = None
    # Without kv_cache_bytes: on GPU the fraction of free device memory (vLLM's
    # gpu_memory_utilization); on CPU the fraction of available RAM, capped by `max_cpu_kv_bytes`.
    memory_fraction: float = 0.9
    # 1 GiB is 21,845 pages of Gemma 3 270M (48 KiB per 16-token page in float16, the default
    # over its GGUF blocks; 10,922 in float32). Pages are shared by its 6 layer groups as needed:
    # one long sequence always fits ~342k tokens, 32 at once ~257k (the sliding groups hold their
    # windows). On the CPU a page that no token reaches costs no resident memory.
    max_cpu_kv_bytes: int = 1 << 30
    # Reuse full blocks across requests by content hash.
    enable_prefix_caching: bool = True
    # An unreferenced cached block idle longer than this is dropped (the seeds' attention_cache_ttl).
    prefix_ttl_s: float = 300.0
    # Requests with a session id keep their last N turns ahead of anonymous blocks (cache_window).
    session_turns: int = 4
    # KV storage: "auto" is float16 over a GGUF's own blocks, else the model's dtype; "float16"
    # and "bfloat16" hold twice the tokens of float32; "int8" / "fp8" (e4m3) about twice those
    # of 16 bits (4x float32) in the same bytes, with a per-token, per-head scale.
    kv_cache_dtype: str = "auto"
    # NOTE: the two gate switches below cover model.quantization too; they sit here because this
    # session owns only this config section (see docs/quantization.md).
    # Run the accuracy gate (tidal quantize-check) before serving a quantized model or KV cache.
    quantization_gate: bool = True
    # The largest perplexity rise (percent) the gate accepts.
    quantization_gate_threshold_pct: float = 1.0
    # Score only the first N held-out tokens (None: all of them, ~4k on Gemma 3); fewer is a
    # faster, noisier gate, meant for tests and quick experiments.
    quantization_gate_max_tokens: int | None = None
    # Serve even when the gate measures a perplexity rise past the threshold.
    force_quantization: bool = False

    def __post_init__(self) -> None:
        check(
            self.block_size > 0 and self.block_size % 8 == 0,
            "block_size",
            self.block_size,
            "a positive multiple of 8",
        )
        check(
            self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
            "kv_cache_bytes",
            self.kv_cache_bytes,
            "a positive integer or None",
        )
        check(
            self.kv_cache_tokens is None or self.kv_cache_tokens > 0,
            "kv_cache_tokens",
            self.kv_cache_tokens,
            "a positive integer or None",
        )
        check(
            self.kv_cache_tokens is None or self.kv_cache_bytes is None,
            "kv_cache_tokens",
            self.kv_cache_tokens,
            "null when kv_cache_bytes is set (the pool is sized by one of the two)",
        )
        check(
            0.0 < self.memory_fraction <= 1.0,
            "memory_fraction",
            self.memory_fraction,
            "a number in (0, 1]",
        )
        check(
            self.max_cpu_kv_bytes > 0,
            "max_cpu_kv_bytes",
            self.max_cpu_kv_bytes,
            "a positive integer",
        )
        check(
            self.prefix_ttl_s > 0, "prefix_ttl_s", self.prefix_ttl_s, "a positive number of seconds"
        )
        check(self.session_turns >= 0, "session_turns", self.session_turns, "an integer >= 0")
        check(
            self.quantization_gate_threshold_pct >= 0,
            "quantization_gate_threshold_pct",
            self.quantization_gate_threshold_pct,
            "a percentage >= 0",
        )
        check(
            self.quantization_gate_max_tokens is None or self.quantization_gate_max_tokens >= 2,
            "quantization_gate_max_tokens",
            self.quantization_gate_max_tokens,
            "an integer >= 2 or None",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"one of {', '.join(KV_CACHE_DTYPES)}",
        )
