"""ArchConfig: one normalized description of a decoder-only transformer, from HF config.json or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidal.config.moe import (
    MLA_FAMILIES,
    MLAConfig,
    MoEConfig,
    deepseek2_from_gguf,
    mla_from_hf,
    moe_from_hf,
)

FULL = "full_attention"
SLIDING = "sliding_attention"

# HF `architectures` / `model_type` and GGUF `general.architecture` -> tidal family.
_FAMILY_BY_NAME = {
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "mistral": "mistral",
    "MistralForCausalLM": "mistral",
    "qwen2": "qwen2",
    "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3moe": "qwen3_moe",  # llama.cpp's GGUF architecture name
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "mixtral": "mixtral",
    "MixtralForCausalLM": "mixtral",
    "deepseek_v2": "deepseek_v2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "deepseek2": "deepseek_v2",  # llama.cpp's one GGUF architecture for DeepSeek V2 and V3
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of one layer type. `scaling` holds HF's rope_scaling dict (llama3, linear)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] = ()

    def scaling_dict(self) -> dict[str, Any]:
        return dict(self.scaling)


@dataclass(frozen=True, slots=True)
class ArchConfig:
    family: str  # a value of _FAMILY_BY_NAME: "gemma3", "llama", ..., "deepseek_v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    rope: dict[str, RopeConfig] = field(default_factory=dict)  # per layer type
    sliding_window: int | None = None
    hidden_act: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Gemma: attention scale is query_pre_attn_scalar**-0.5 instead of head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts: the router and expert sizes, and which layers are sparse (the others
    # run the dense GatedMLP of intermediate_size).
    moe: MoEConfig | None = None
    moe_layers: tuple[int, ...] = ()
    mla: MLAConfig | None = None

    @property
    def kv_cache_heads(self) -> int:
        """Heads one token stores per layer: MLA's latent is one shared head."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.mla.latent_dim if self.mla else self.head_dim

    @property
    def kv_cache_parts(self) -> int:
        """2: separate K and V pages; 1: MLA's latent is both."""
        return 1 if self.mla else 2

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    def window(self, layer_id: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_id] == SLIDING else None

    def layer_windows(self) -> list[int | None]:
        return [self.window(i) for i in range(self.num_layers)]

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, expected num_layers={self.num_layers}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a positive sliding_window")
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers are set without a MoEConfig")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ValueError(
                f"moe_layers={self.moe_layers} name layers outside 0..{self.num_layers - 1}"
            )


def family_of(name: str) -> str:
    try:
        return _FAMILY_BY_NAME[name]
    except KeyError:
        known = sorted({k for k in _FAMILY_BY_NAME if k.islower()})
        raise ValueError(f"architecture {name!r} is not supported; supported: {known}") from None


def _rope_from_hf(cfg: dict[str, Any]) -> dict[str, RopeConfig]:
    """Read rope settings from transformers 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters)."""

    def one(d: dict[str, Any], default_theta: float) -> RopeConfig:
        d = dict(d or {})
        theta = float(d.pop("rope_theta", default_theta))
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "default":
            return RopeConfig(theta)
        d["rope_type"] = kind
        d.pop("type", None)
        return RopeConfig(theta, tuple(sorted(d.items())))

    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        return {k: one(v, 10000.0) for k, v in params.items()}
    if isinstance(params, dict):
        rope = one(params, float(cfg.get("rope_theta", 10000.0)))
    else:
        rope = one(cfg.get("rope_scaling") or {}, float(cfg.get("rope_theta", 10000.0)))
    out = {FULL: rope, SLIDING: rope}
    if "rope_local_base_freq" in cfg:  # Gemma 3 in transformers 4.x
        out[SLIDING] = RopeConfig(float(cfg["rope_local_base_freq"]))
    return out


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def arch_from_hf(cfg: dict[str, Any]) -> ArchConfig:
    """Normalize a HF config.json dict."""
    quant = cfg.get("quantization_config")
    # "gguf": transformers dequantized a GGUF to float on load, so a saved directory holds floats.
    if isinstance(quant, dict) and quant.get("quant_method") not in (None, "gguf"):
        # NOTE: DeepSeek-V3/R1 ship FP8 weights with per-block scales (weight_scale_inv); read
        # as plain floats they would load without error and compute garbage.
        raise ValueError(
            f"quantization_config.quant_method={quant['quant_method']!r} is not supported: "
            "tidal reads float (float32/bfloat16/float16) safetensors or GGUF files; convert the "
            "checkpoint to bfloat16 (DeepSeek's fp8_cast_bf16.py does for V3/R1) or to GGUF"
        )
    names = list(cfg.get("architectures") or []) + [cfg.get("model_type", "")]
    family = next((family_of(n) for n in names if n in _FAMILY_BY_NAME), None)
    if family is None:
        family_of(names[0] if names and names[0] else str(cfg.get("model_type")))
    assert family is not None
    if "text_config" in cfg:  # multimodal wrapper (Gemma3ForConditionalGeneration)
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", "gemma3_text")
        return arch_from_hf(inner)
    num_layers = int(cfg["num_hidden_layers"])
    num_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if family == "gemma3":
        if not layer_types:
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    elif family in ("mistral", "mixtral"):
        layer_types = [SLIDING if window else FULL] * num_layers
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        if not cfg.get("use_sliding_window") or not window:
            layer_types = [FULL] * num_layers
            window = None
        elif not layer_types:
            start = int(cfg.get("max_window_layers", num_layers))
            layer_types = [FULL if i < start else SLIDING for i in range(num_layers)]
    if not layer_types:
        layer_types = [FULL] * num_layers
    if SLIDING not in layer_types:
        window = None
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    moe, moe_layers = moe_from_hf(cfg, family, num_layers)
    mla = mla_from_hf(cfg) if family in MLA_FAMILIES else None
    if mla is not None:
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return ArchConfig(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        layer_types=tuple(layer_types),
        rope=_rope_from_hf(cfg),
        sliding_window=int(window) if window else None,
        hidden_act=act,
        qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")),
        qk_norm=family in ("gemma3", "qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        moe=moe,
        moe_layers=moe_layers,
        mla=mla,
    )


# Gemma 3 settings that llama.cpp's GGUF export does not store: they come from the architecture.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def arch_from_gguf(meta: dict[str, Any], has_output_tensor: bool) -> ArchConfig:
    """Normalize GGUF metadata (llama.cpp key names)."""
    arch = str(meta["general.architecture"])
    family = family_of(arch)

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    if family == "llama" and key("expert_count"):  # llama.cpp writes Mixtral as llama + experts
        family = "mixtral"

    num_layers = int(key("block_count"))
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv = key("attention.head_count_kv", num_heads)
    if not isinstance(num_kv, int):  # per-layer arrays exist in some files; all equal here
        num_kv = int(num_kv[0])
    head_dim = int(key("attention.key_length", hidden // num_heads))
    window = key("attention.sliding_window")
    theta = float(key("rope.freq_base", 10000.0))
    scaling: dict[str, Any] = {}
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    elif scaling_type == "yarn" and family in MLA_FAMILIES:
        # llama.cpp stores DeepSeek's 0.1 * mscale_all_dim as the log multiplier, and not
        # mscale: its released configs have mscale == mscale_all_dim (cos/sin factor 1).
        mscale = float(key("rope.scaling.yarn_log_multiplier", 0.1)) / 0.1
        scaling = {
            "rope_type": "yarn",
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale,
            "mscale_all_dim": mscale,
        }
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope.scaling.type={scaling_type!r} is not supported")
    rope_full = RopeConfig(theta, tuple(sorted(scaling.items())))
    rope = {FULL: rope_full, SLIDING: rope_full}
    vocab = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(key("vocab_size", len(vocab) if vocab is not None else 0))
    query_pre_attn_scalar = None
    if family == "gemma3":
        layer_types = [
            FULL if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else SLIDING for i in range(num_layers)
        ]
        rope[SLIDING] = RopeConfig(GEMMA3_LOCAL_ROPE_THETA)
        # llama.cpp: 27B scales by hidden/heads, every other size by head_dim.
        query_pre_attn_scalar = hidden // num_heads if num_layers == 62 else head_dim
        act = "gelu_pytorch_tanh"
    else:
        layer_types = [SLIDING if window else FULL] * num_layers
        act = "silu"
    if SLIDING not in layer_types:
        window = None
    mla = moe = None
    moe_layers: tuple[int, ...] = ()
    if family in MLA_FAMILIES:
        mla, moe, moe_layers = deepseek2_from_gguf(key, num_layers)
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        num_kv = num_heads  # llama.cpp's MQA form says 1: the one latent head
    elif family in ("qwen3_moe", "mixtral"):
        # llama.cpp runs every layer sparse and renormalizes the top-k weights for both.
        moe = MoEConfig(
            num_experts=int(key("expert_count")),
            top_k=int(key("expert_used_count")),
            intermediate_size=int(key("expert_feed_forward_length") or key("feed_forward_length")),
            norm_topk_prob=True,
        )
        moe_layers = tuple(range(num_layers))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ArchConfig(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", moe.intermediate_size if moe else 0)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 8192)),
        layer_types=tuple(layer_types),
        rope=rope,
        sliding_window=int(window) if window else None,
        hidden_act=act,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("gemma3", "qwen3", "qwen3_moe"),
        tie_word_embeddings=not has_output_tensor,
        query_pre_attn_scalar=query_pre_attn_scalar,
        final_logit_softcapping=key("final_logit_softcapping"),
        attn_logit_softcapping=key("attn_logit_softcapping"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_ids(eos),
        moe=moe,
        moe_layers=moe_layers,
        mla=mla,
    )
