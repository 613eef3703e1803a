"""The layout table: 7B-class architectures' exact shapes and llama.cpp's quantization recipes.

A layout is what llama.cpp's convert_hf_to_gguf.py and llama-quantize would write for the model:
tensor names, torch-order shapes, ggml block types and their order in the file, and the
architecture's metadata keys. The types follow llama.cpp's `llama_tensor_get_type`
(src/llama-quant.cpp) for the four recipes here; e.g. Qwen2.5-7B Q4_K_M (28 layers):

    token_embd Q4_K, output Q6_K, norms and biases F32 (1-D tensors are never quantized)
    attn_v, ffn_down   Q6_K on layers 0-2, 5, 8, 11, 14, 17, 20, 23, 24-27 (use_more_bits), else Q4_K
    everything else    Q4_K

The tensors are ordered as llama-quantize writes them: the tensors outside the blocks first, then
block by block, each group by name (llama_model_loader's weight_name_comparer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from tidal.bench.twin_header import BOOL, FLOAT32, STRING, UINT32, MetaValue, TensorSpec, meta
from tidal.quant.gguf_types import BLOCK_SIZES, GGMLType

QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION, written by llama-quantize


@dataclass(frozen=True, slots=True)
class Llama3Rope:
    """Llama 3.1's rope scaling, which convert_hf_to_gguf.py stores as a `rope_freqs` tensor."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA), in config.json's names. llama.cpp's current
    `deepseek2` form splits kv_b_proj into attn_k_b (heads, rank, nope) and attn_v_b (heads, v,
    rank), and records the MQA sizes (one KV head of rank + rope values)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a full-rank attn_q (V2-Lite)


@dataclass(frozen=True, slots=True)
class Experts:
    """The routed and shared experts of a mixture-of-experts model."""

    count: int  # routed experts per sparse layer
    used: int  # experts per token
    intermediate_size: int  # one expert's
    shared: int = 0  # shared experts, stored as one MLP of shared * intermediate_size
    leading_dense: int = 0  # the first layers keep a dense MLP
    gating: int = 1  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
    weights_norm: bool = False
    weights_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN rope scaling as convert_hf_to_gguf.py records DeepSeek's."""

    factor: float
    original_context_length: int
    log_multiplier: float  # 0.1 * mscale_all_dim


@dataclass(frozen=True, slots=True)
class Architecture:
    """One model's hyperparameters, as its config.json gives them."""

    name: str  # the twin name's prefix, e.g. "qwen2.5-7b"
    title: str  # general.name
    gguf_arch: str  # general.architecture
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k
    tied_embeddings: bool = False  # no output.weight: the embedding is the output projection
    llama3_rope: Llama3Rope | None = None
    size_label: str = "7B"
    mla: LatentAttention | None = None
    experts: Experts | None = None
    yarn: Yarn | None = None

    def tiny(self) -> Architecture:
        """The same structure at test size (every layer, 256 wide, 512 tokens): seconds to write."""
        # the latent keeps its real 512 + 64 values: ik_llama.cpp accepts no other MQA form
        mla = self.mla and replace(self.mla, qk_nope_head_dim=32, v_head_dim=32,
                                   q_lora_rank=self.mla.q_lora_rank and 192)  # fmt: skip
        # 16 experts: llama-quantize treats 8-expert models (Mixtral) apart
        experts = self.experts and replace(self.experts, count=16, used=2, intermediate_size=128)
        return replace(self, name=f"{self.name}-tiny", title=f"{self.title} (tiny)",
                       hidden_size=256, intermediate_size=512, num_heads=4,
                       num_kv_heads=1 if mla else 2, head_dim=64, vocab_size=512,
                       context_length=4096, mla=mla, experts=experts)  # fmt: skip


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama-3.1-8b", "Meta Llama 3.1 8B", "llama", 32, 4096, 14336, 32, 8, 128,
                     128256, 131072, 500000.0, 1e-5, llama3_rope=Llama3Rope(), size_label="8B"),
        Architecture("qwen2.5-7b", "Qwen2.5 7B", "qwen2", 28, 3584, 18944, 28, 4, 128,
                     152064, 32768, 1000000.0, 1e-6, qkv_bias=True),
        Architecture("mistral-7b-v0.3", "Mistral 7B v0.3", "llama", 32, 4096, 14336, 32, 8, 128,
                     32768, 32768, 1000000.0, 1e-5),
        Architecture("qwen3-8b", "Qwen3 8B", "qwen3", 36, 4096, 12288, 32, 8, 128,
                     151936, 40960, 1000000.0, 1e-6, qk_norm=True, size_label="8B"),
        # Qwen2.5-Math-7B's shapes (the distill's base); its rope theta is 10,000
        Architecture("deepseek-r1-distill-qwen-7b", "DeepSeek R1 Distill Qwen 7B", "qwen2", 28,
                     3584, 18944, 28, 4, 128, 152064, 131072, 10000.0, 1e-6, qkv_bias=True),
        # DeepSeek-V2-Lite: MLA without q_lora, 64 routed experts (6 a token) + 2 shared, layer 0
        # dense; num_kv_heads 1 and head_dim 576 are the MQA form llama.cpp records
        Architecture("deepseek-v2-lite", "DeepSeek V2 Lite", "deepseek2", 27, 2048, 10944, 16, 1,
                     576, 102400, 163840, 10000.0, 1e-6, size_label="16B",
                     mla=LatentAttention(512, 128, 64, 128),
                     experts=Experts(64, 6, 1408, shared=2, leading_dense=1),
                     yarn=Yarn(40.0, 4096, 0.1 * 0.707)),
    )
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Recipe:
    """A llama-quantize file type: its default block type and the llama_ftype it records."""

    name: str
    file_type: int  # general.file_type (llama_ftype)
    default_type: GGMLType
    more_bits: bool = False  # Q4_K_M, Q5_K_M: attn_v and ffn_down Q6_K on use_more_bits layers


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("q4_k_m", 15, GGMLType.Q4_K, more_bits=True),
        Recipe("q5_k_m", 17, GGMLType.Q5_K, more_bits=True),
        Recipe("q6_k", 18, GGMLType.Q6_K),
        Recipe("q8_0", 7, GGMLType.Q8_0),
    )
}

# llama.cpp's fallback when a row is not a whole number of the chosen type's blocks
_FALLBACK = {
    GGMLType.Q4_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_1,
    GGMLType.Q6_K: GGMLType.Q8_0,
}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i_layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every
    third layer between."""
    eighth = num_layers // 8
    return i_layer < eighth or i_layer >= 7 * num_layers // 8 or (i_layer - eighth) % 3 == 2


def tensor_type(
    recipe: Recipe, spec: TensorSpec, num_layers: int, tied: bool, num_experts: int = 0
) -> GGMLType:
    """The block type llama-quantize gives one tensor (llama_tensor_get_type for these ftypes:
    tensors by category, `ffn_down` covering the experts' and shared experts' too, then the
    fallback for rows that are not whole blocks)."""
    name = spec.name
    if len(spec.shape) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return GGMLType.F32  # converted as F32 and never quantized
    if "ffn_gate_inp.weight" in name:
        return GGMLType.F32  # the router is never quantized
    chosen = recipe.default_type
    cols = spec.shape[-1]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if cols % BLOCK_SIZES[chosen][0] or chosen == GGMLType.Q8_0:
            return GGMLType.Q8_0
        chosen = GGMLType.Q6_K
    elif name == "token_embd.weight":
        pass
    elif "attn_v.weight" in name or "attn_kv_b.weight" in name:
        if recipe.more_bits and use_more_bits(_layer_of(name), num_layers):
            chosen = GGMLType.Q6_K
        if num_experts == 8:  # Mixtral: "trades just ~128MB"
            chosen = GGMLType.Q8_0
    elif "attn_k.weight" in name:
        if num_experts == 8:
            chosen = GGMLType.Q8_0
    elif "attn_output.weight" in name:
        if num_experts == 8 and recipe.name == "q4_k_m":
            chosen = GGMLType.Q5_K
    elif "ffn_down" in name and recipe.more_bits:
        if use_more_bits(_layer_of(name), num_layers):
            chosen = GGMLType.Q6_K
    if cols % BLOCK_SIZES[chosen][0]:
        chosen = _FALLBACK.get(chosen, GGMLType.F16)
        if cols % BLOCK_SIZES[chosen][0]:
            chosen = GGMLType.F16
    return chosen


def llama_order(tensors: list[TensorSpec]) -> list[TensorSpec]:
    """llama-quantize's order: tensors outside the blocks (layer -1) first, then by layer, by name."""
    return sorted(tensors, key=lambda t: (_layer_of(t.name), t.name))


def table_tensors(arch: Architecture, recipe: Recipe) -> list[TensorSpec]:
    """Every tensor of `arch` quantized with `recipe`, in the file's order."""
    h, ff, q, kv = (arch.hidden_size, arch.intermediate_size, arch.num_heads * arch.head_dim,
                    arch.num_kv_heads * arch.head_dim)  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (arch.vocab_size, h),
                                          "output_norm.weight": (h,)}  # fmt: skip
    if not arch.tied_embeddings:
        shapes["output.weight"] = (arch.vocab_size, h)
    if arch.llama3_rope is not None:
        shapes["rope_freqs.weight"] = (arch.head_dim // 2,)
    for i in range(arch.num_layers):
        layer = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
                 "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,)}  # fmt: skip
        if arch.mla is not None:
            layer = {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), **_mla_tensors(arch)}
        if arch.experts is None or i < arch.experts.leading_dense:
            layer.update({"ffn_gate.weight": (ff, h), "ffn_up.weight": (ff, h),
                          "ffn_down.weight": (h, ff)})  # fmt: skip
        else:
            layer.update(_expert_tensors(arch, arch.experts))
        if arch.qkv_bias:
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if arch.qk_norm:
            layer.update({"attn_q_norm.weight": (arch.head_dim,),
                          "attn_k_norm.weight": (arch.head_dim,)})  # fmt: skip
        shapes.update({f"blk.{i}.{short}": shape for short, shape in layer.items()})
    specs = [TensorSpec(name, shape, GGMLType.F32) for name, shape in shapes.items()]
    experts = arch.experts.count if arch.experts else 0
    return llama_order(
        [
            replace(
                s, ggml_type=tensor_type(recipe, s, arch.num_layers, arch.tied_embeddings, experts)
            )  # fmt: skip
            for s in specs
        ]
    )


def _mla_tensors(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """One layer's MLA projections (torch-order shapes) in llama.cpp's split form."""
    m, h, heads = arch.mla, arch.hidden_size, arch.num_heads
    assert m is not None
    q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    out = {"attn_kv_a_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
           "attn_kv_a_norm.weight": (m.kv_lora_rank,),
           "attn_k_b.weight": (heads, m.kv_lora_rank, m.qk_nope_head_dim),
           "attn_v_b.weight": (heads, m.v_head_dim, m.kv_lora_rank),
           "attn_output.weight": (h, heads * m.v_head_dim)}  # fmt: skip
    if m.q_lora_rank is None:
        out["attn_q.weight"] = (heads * q_head, h)
    else:
        out.update({"attn_q_a.weight": (m.q_lora_rank, h), "attn_q_a_norm.weight": (m.q_lora_rank,),
                    "attn_q_b.weight": (heads * q_head, m.q_lora_rank)})  # fmt: skip
    return out


def _expert_tensors(arch: Architecture, e: Experts) -> dict[str, tuple[int, ...]]:
    """One sparse layer's router, stacked experts and shared experts."""
    h, ff = arch.hidden_size, e.intermediate_size
    out = {"ffn_gate_inp.weight": (e.count, h), "ffn_gate_exps.weight": (e.count, ff, h),
           "ffn_up_exps.weight": (e.count, ff, h), "ffn_down_exps.weight": (e.count, h, ff)}  # fmt: skip
    if e.shared:
        sh = e.shared * ff
        out.update({"ffn_gate_shexp.weight": (sh, h), "ffn_up_shexp.weight": (sh, h),
                    "ffn_down_shexp.weight": (h, sh)})  # fmt: skip
    return out


def table_metadata(
    arch: Architecture, recipe: Recipe, description: str
) -> tuple[list[MetaValue], list[MetaValue]]:
    """The metadata before and after the tokenizer's keys, in convert_hf_to_gguf.py's order."""
    a = arch.gguf_arch
    head = [meta("general.architecture", a, STRING), meta("general.type", "model", STRING),
            meta("general.name", arch.title, STRING),
            meta("general.description", description, STRING),
            meta("general.size_label", arch.size_label, STRING),
            *_keys(a, ("block_count", arch.num_layers), ("context_length", arch.context_length),
                   ("embedding_length", arch.hidden_size),
                   ("feed_forward_length", arch.intermediate_size),
                   ("attention.head_count", arch.num_heads),
                   ("attention.head_count_kv", arch.num_kv_heads),
                   ("rope.freq_base", arch.rope_theta),
                   ("attention.layer_norm_rms_epsilon", arch.rms_norm_eps))]  # fmt: skip
    if arch.experts is not None:
        head += _keys(a, ("expert_used_count", arch.experts.used))
    if arch.mla is not None:
        head += _deepseek2_metadata(arch)
    elif arch.qk_norm or arch.head_dim * arch.num_heads != arch.hidden_size:
        head += _keys(a, ("attention.key_length", arch.head_dim),
                      ("attention.value_length", arch.head_dim))  # fmt: skip
    if a == "llama":
        head += _keys(a, ("vocab_size", arch.vocab_size), ("rope.dimension_count", arch.head_dim))
    tail = [meta("general.quantization_version", QUANTIZATION_VERSION, UINT32),
            meta("general.file_type", recipe.file_type, UINT32)]  # fmt: skip
    return head, tail


def _keys(arch: str, *items: tuple[str, object]) -> list[MetaValue]:
    """`{arch}.{key}` values, typed as convert_hf_to_gguf.py writes them: bool, float32, uint32
    or string by the Python value."""
    types = {bool: BOOL, float: FLOAT32, int: UINT32, str: STRING}
    return [meta(f"{arch}.{key}", value, types[type(value)]) for key, value in items]


def _deepseek2_metadata(arch: Architecture) -> list[MetaValue]:
    """convert_hf_to_gguf.py's DeepSeek V2 keys: the MQA form of the latent's sizes (key_length
    rank + rope, value_length rank) with the per-head ones in the _mla keys, the experts, YaRN."""
    a, m, e = arch.gguf_arch, arch.mla, arch.experts
    assert m is not None and e is not None
    q_lora = () if m.q_lora_rank is None else (("attention.q_lora_rank", m.q_lora_rank),)
    out = _keys(a, ("vocab_size", arch.vocab_size), ("leading_dense_block_count", e.leading_dense),
                *q_lora, ("attention.kv_lora_rank", m.kv_lora_rank),
                ("attention.key_length", m.kv_lora_rank + m.qk_rope_head_dim),
                ("attention.value_length", m.kv_lora_rank),
                ("attention.key_length_mla", m.qk_nope_head_dim + m.qk_rope_head_dim),
                ("attention.value_length_mla", m.v_head_dim),
                ("expert_feed_forward_length", e.intermediate_size), ("expert_count", e.count),
                ("expert_shared_count", e.shared), ("expert_weights_scale", e.weights_scale),
                ("expert_weights_norm", e.weights_norm), ("expert_gating_func", e.gating),
                ("rope.dimension_count", m.qk_rope_head_dim))  # fmt: skip
    if arch.yarn is not None:
        y = arch.yarn
        out += _keys(a, ("rope.scaling.type", "yarn"), ("rope.scaling.factor", y.factor),
                     ("rope.scaling.original_context_length", y.original_context_length),
                     ("rope.scaling.yarn_log_multiplier", y.log_multiplier))  # fmt: skip
    return out


def llama3_rope_factors(arch: Architecture) -> list[float]:
    """`rope_freqs.weight`: each rotary frequency's divisor under Llama 3.1's scaling (1 for the
    short wavelengths, `factor` for the long ones, a smooth blend between)."""
    rope = arch.llama3_rope
    assert rope is not None
    low_wavelen = rope.original_context_length / rope.low_freq_factor
    high_wavelen = rope.original_context_length / rope.high_freq_factor
    factors = []
    for i in range(0, arch.head_dim, 2):
        wavelen = 2 * math.pi * arch.rope_theta ** (i / arch.head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope.factor)
        else:
            smooth = (rope.original_context_length / wavelen - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / rope.factor + smooth))
    return factors


def keep_layers(tensors: list[TensorSpec], num_layers: int) -> list[TensorSpec]:
    """The tensors of the first `num_layers` blocks and those outside the blocks."""
    return [t for t in tensors if _layer_of(t.name) < num_layers]


def _layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return int(m[1]) if m else -1
