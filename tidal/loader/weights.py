"""Turn checkpoint tensors (safetensors or GGUF) into tidal's HF-named state dict."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tidal.config.arch import ArchConfig

if TYPE_CHECKING:
    from tidal.kernels.gguf_gemm import BlockWeight
    from tidal.loader.shard import TensorSlice

# llama.cpp tensor name -> HF name; "{}" is the layer index.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # DeepSeek V2/V3 (llama.cpp's deepseek2): MLA projections, router, shared experts
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Routed experts are stacked in one (experts, rows, cols) tensor per projection in GGUF files.
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Mixtral's checkpoints name the MoE block and its experts' projections differently from the
# DeepSeek / Qwen3-MoE layout tidal's SparseMoE uses (mlp.experts.N.gate_proj, ...).
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def _mixtral_to_tidal_name(name: str) -> str:
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}.", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def gguf_to_hf_name(name: str, family: str) -> str | None:
    """HF name of a llama.cpp tensor, or None for tensors tidal does not use (e.g. rope_freqs)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if not m:
        return None
    layer, short, kind = m.groups()
    if short == "exp_probs_b":  # DeepSeek-V3's routing bias, stored as a ".bias"
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    if short in _GGUF_EXPERT_NAMES:  # a template: format() it with the expert index
        return f"model.layers.{layer}.mlp.experts.{{}}.{_GGUF_EXPERT_NAMES[short]}.{kind}"
    if family == "gemma3":
        # Gemma's four norms: attn_norm, post_attention_norm, ffn_norm (pre-FFN), post_ffw_norm.
        gemma = {
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }
        if short in gemma:
            return f"model.layers.{layer}.{gemma[short]}.{kind}"
    elif short == "ffn_norm":
        return f"model.layers.{layer}.post_attention_layernorm.{kind}"
    if short not in _GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[short]}.{kind}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Q/K for llama-arch files (its rotary pairs adjacent
    elements; tidal, like transformers, rotates the two halves of each head)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def iter_gguf_weights(
    path: Path,
    arch: ArchConfig,
    gguf_arch: str,
    keep_blocks: Callable[[str], bool] | None = None,
    huge_pages: bool = True,
) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
    """Yield (HF name, float32 tensor) for every tensor of a GGUF file, in HF conventions.

    Where `keep_blocks(hf_name)` is true and tidal's kernels read the tensor's block type, the
    tensor comes as a BlockWeight over the file's own bytes instead (memory-mapped, not copied,
    except Llama's Q/K rows, which are reordered; tensors of RESIDENT_MIN_BYTES and more are
    mapped where tidal/loader/resident.py can later move them into huge pages, unless
    `huge_pages` is false)."""
    from tidal.kernels.gguf_gemm import SUPPORTED_TYPES, BlockWeight
    from tidal.loader.gguf_file import GGUFFile
    from tidal.loader.resident import map_resident, wants_resident

    with GGUFFile(path, metadata=False) as f:  # the header was parsed for the arch already
        for name, info in f.tensors.items():
            if name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
                kv_b = _joined_kv_b(f, name, arch)
                if kv_b is not None:
                    yield kv_b
                if keep_blocks is not None and int(info.ggml_type) in SUPPORTED_TYPES:
                    yield _latent_blocks(f, name)
                continue
            hf = gguf_to_hf_name(name, arch.family)
            if hf is None:
                continue
            if "{}" in hf:  # stacked routed experts: one 2-D weight per expert
                yield from _split_experts(f, name, hf, keep_blocks)
                continue
            permuted = gguf_arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight"))
            if (
                keep_blocks is not None
                and len(info.shape) == 2
                and int(info.ggml_type) in SUPPORTED_TYPES
                and keep_blocks(hf)
            ):
                rows, cols = info.shape
                if huge_pages and wants_resident(info.nbytes) and not permuted:  # resident.py
                    blocks = map_resident(path, info.offset, info.nbytes).view(rows, -1)
                else:
                    blocks = torch.from_numpy(f.raw(name)).view(rows, -1)  # (rows, row_bytes)
                if permuted:
                    heads = arch.num_heads if "q_proj" in hf else arch.num_kv_heads
                    blocks = unpermute_qk(blocks, heads).contiguous()
                yield hf, BlockWeight(blocks, int(info.ggml_type), rows, cols)
                continue
            t = f.load_tensor(name, torch.float32)
            if arch.family == "gemma3" and name.endswith("norm.weight"):
                t = t - 1.0  # llama.cpp stores Gemma's norm weights with the +1 folded in
            if permuted:
                heads = arch.num_heads if "q_proj" in hf else arch.num_kv_heads
                t = unpermute_qk(t, heads)
            yield hf, t


def _split_experts(
    f, name: str, template: str, keep_blocks: Callable[[str], bool] | None
) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
    """A stacked (experts, rows, cols) GGUF tensor as each expert's weight: a BlockWeight over
    its rows of the file's bytes where the kernels read the type, else dequantized."""
    from tidal.kernels.gguf_gemm import SUPPORTED_TYPES, BlockWeight

    info = f.tensors[name]
    num_experts, rows, cols = info.shape
    if keep_blocks is not None and int(info.ggml_type) in SUPPORTED_TYPES:
        blocks = torch.from_numpy(f.raw(name)).view(num_experts, rows, -1)
        for e in range(num_experts):
            hf = template.format(e)
            if keep_blocks(hf):
                yield hf, BlockWeight(blocks[e], int(info.ggml_type), rows, cols)
            else:
                yield hf, f.load_tensor(name, torch.float32)[e]
        return
    stacked = f.load_tensor(name, torch.float32)  # (E, rows, cols)
    for e in range(num_experts):
        yield template.format(e), stacked[e]


def _latent_blocks(f, name: str) -> tuple[str, BlockWeight]:
    """attn_k_b (H, rank, nope) or attn_v_b (H, v, rank) of a split deepseek2 file as one
    BlockWeight over the file's bytes, every head's rows stacked: `w_uk_blocks` (H * rank, nope)
    holds W_UK[h] transposed, `w_uv_blocks` (H * v, rank) W_UV[h], the forms an absorbed decode
    multiplies by (tidal/layers/mla_attention.py)."""
    from tidal.kernels.gguf_gemm import BlockWeight

    info = f.tensors[name]
    heads, rows, cols = info.shape
    blocks = torch.from_numpy(f.raw(name)).view(heads * rows, -1)
    layer = name.split(".")[1]
    kind = "w_uk_blocks" if name.endswith("attn_k_b.weight") else "w_uv_blocks"
    weight = BlockWeight(blocks, int(info.ggml_type), heads * rows, cols)
    return f"model.layers.{layer}.self_attn.{kind}", weight


def _joined_kv_b(f, name: str, arch: ArchConfig) -> tuple[str, torch.Tensor] | None:
    """Newer llama.cpp files split DeepSeek's kv_b_proj into attn_k_b (H, rank, nope) and
    attn_v_b (H, v, rank); join them back into kv_b_proj (H * (nope + v), rank) once the
    second arrives. None: a file with attn_kv_b itself (that one is used), or the first half."""
    prefix = name.rsplit(".", 2)[0]  # blk.N
    if f"{prefix}.attn_kv_b.weight" in f.tensors or arch.mla is None:
        return None
    k_name, v_name = f"{prefix}.attn_k_b.weight", f"{prefix}.attn_v_b.weight"
    if name != max(k_name, v_name, key=list(f.tensors).index):
        return None
    if k_name not in f.tensors or v_name not in f.tensors:
        raise ValueError(f"{f.path}: {prefix} has only one of attn_k_b and attn_v_b")
    k_b = f.load_tensor(k_name, torch.float32).transpose(1, 2)  # (H, nope, rank)
    v_b = f.load_tensor(v_name, torch.float32)  # (H, v, rank)
    kv_b = torch.cat((k_b, v_b), dim=1)  # (H, nope + v, rank)
    layer = prefix.split(".")[1]
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])


def iter_safetensors_weights(
    model_dir: Path, slice_of: Callable[[str], TensorSlice | None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a HF directory's (possibly sharded) safetensors files; where
    `slice_of(name)` gives a slice, only those rows or columns are read."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files")
    for file in files:
        with safe_open(model_dir / file, framework="pt") as f:
            for name in f.keys():
                hf = name
                if hf.startswith("language_model."):  # multimodal wrappers keep the text model here
                    hf = hf[len("language_model.") :]
                if hf.startswith("model.language_model."):
                    hf = "model." + hf[len("model.language_model.") :]
                if ".block_sparse_moe." in hf:
                    hf = _mixtral_to_tidal_name(hf)
                part = None if slice_of is None else slice_of(hf)
                if part is None:
                    yield hf, f.get_tensor(name)
                elif part.dim == 0:
                    yield hf, f.get_slice(name)[part.start : part.stop]
                else:
                    yield hf, f.get_slice(name)[:, part.start : part.stop]
