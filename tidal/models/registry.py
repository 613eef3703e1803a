"""Maps an ArchConfig family to its model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

from tidal.config.arch import ArchConfig

_MODELS: dict[str, tuple[str, str]] = {
    "gemma3": ("tidal.models.gemma3", "Gemma3ForCausalLM"),
    "llama": ("tidal.models.llama", "LlamaForCausalLM"),
    "mistral": ("tidal.models.llama", "LlamaForCausalLM"),
    "qwen2": ("tidal.models.llama", "LlamaForCausalLM"),
    "qwen3": ("tidal.models.llama", "LlamaForCausalLM"),
    "qwen3_moe": ("tidal.models.llama", "LlamaForCausalLM"),
    "mixtral": ("tidal.models.llama", "LlamaForCausalLM"),
    "deepseek_v2": ("tidal.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("tidal.models.deepseek_v2", "DeepseekV2ForCausalLM"),
}


def supported_families() -> list[str]:
    return sorted(_MODELS)


def check_tensor_parallel(arch: ArchConfig, tensor_parallel: int) -> None:
    """Refuse a split the family's model code cannot run: MLA and MoE layers have no sharded
    form yet (their experts, router and latent projections run whole on one device)."""
    if tensor_parallel > 1 and (arch.mla is not None or arch.moe is not None):
        raise ValueError(
            f"tensor_parallel={tensor_parallel} is not supported for the {arch.family} family "
            "(multi-head latent attention / mixture of experts run on one device): expected 1"
        )


def model_class(arch: ArchConfig) -> type[nn.Module]:
    try:
        module, name = _MODELS[arch.family]
    except KeyError:
        raise ValueError(
            f"model family {arch.family!r} is not supported; supported: {supported_families()}"
        ) from None
    return getattr(importlib.import_module(module), name)
