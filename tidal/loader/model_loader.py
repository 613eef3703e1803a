"""load_model: a checkpoint path (GGUF file or HF directory) -> a ready model, its ArchConfig and tokenizer."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tidal.layers.rotary import RotaryEmbedding, inv_frequencies
from tidal.models.arch import ArchConfig, arch_from_gguf, arch_from_hf
from tidal.models.registry import model_class


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    arch: ArchConfig
    path: Path
    dtype: torch.dtype
    device: torch.device
    load_time_s: float


def read_arch(path: str | Path) -> tuple[ArchConfig, str | None]:
    """The ArchConfig of a checkpoint, and the GGUF architecture name for GGUF files."""
    p = Path(path)
    if p.is_dir():
        config = p / "config.json"
        if not config.exists():
            raise ValueError(
                f"{p} is a directory without config.json; expected a HF model directory"
            )
        return arch_from_hf(json.loads(config.read_text())), None
    if not p.exists():
        raise ValueError(f"model path {str(p)!r} does not exist")
    from tidal.loader.gguf_file import GGUFFile

    with GGUFFile(p) as f:
        return arch_from_gguf(f.metadata, "output.weight" in f.tensors), f.architecture()


def kv_group_of_layers(arch: ArchConfig) -> list[int]:
    """KV group of each layer, as tidal.kv.layout.KVLayout groups them."""
    from tidal.kv.layout import KVLayout

    layout = KVLayout.from_layer_windows(
        arch.layer_windows(),
        block_size=16,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype_bytes=4,
    )
    return [layout.layer_slot(i)[0] for i in range(arch.num_layers)]


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedModel:
    """Build the model on the meta device and assign the checkpoint's tensors, so peak memory stays
    near one copy of the weights."""
    start = time.perf_counter()
    p = Path(path)
    device = torch.device(device)
    arch, gguf_arch = read_arch(p)
    with torch.device("meta"):
        model = model_class(arch)(arch, kv_group_of_layers(arch))
    expected = dict(model.state_dict(keep_vars=True))
    if p.is_dir():
        from tidal.loader.weights import iter_safetensors_weights

        weights = iter_safetensors_weights(p)
    else:
        from tidal.loader.weights import iter_gguf_weights

        assert gguf_arch is not None
        weights = iter_gguf_weights(p, arch, gguf_arch)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name not in expected:
            continue  # e.g. vision tower of a multimodal checkpoint
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{p}: tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        state[name] = tensor.to(device=device, dtype=dtype)
    if arch.tie_word_embeddings or arch.family == "gemma3":
        state.pop("lm_head.weight", None)
    missing = [
        n for n in expected if n not in state and not (n == "lm_head.weight" and _tied(model))
    ]
    if missing:
        raise ValueError(f"{p}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if _tied(model):
        model.lm_head.weight = model.model.embed_tokens.weight
    freq_factors = _gguf_rope_freqs(p) if not p.is_dir() else None
    for module in model.modules():  # non-persistent buffers are still on meta
        if isinstance(module, RotaryEmbedding):
            inv_freq = inv_frequencies(module.head_dim, module.rope)
            if freq_factors is not None:
                inv_freq = inv_freq / freq_factors  # llama.cpp's form of Llama 3.1 rope scaling
            module.inv_freq = inv_freq.to(device)
    model.eval().requires_grad_(False)
    return LoadedModel(model, arch, p, dtype, device, time.perf_counter() - start)


def _gguf_rope_freqs(path: Path) -> torch.Tensor | None:
    from tidal.loader.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        return f.load_tensor("rope_freqs.weight") if "rope_freqs.weight" in f.tensors else None


def _tied(model: nn.Module) -> bool:
    arch: ArchConfig = model.arch  # type: ignore[assignment]
    return arch.tie_word_embeddings or arch.family == "gemma3"
