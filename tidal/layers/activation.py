"""Activation functions by their HF config names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTS[name]
    except KeyError:
        raise ValueError(
            f"hidden_act={name!r} is not supported; supported: {sorted(_ACTS)}"
        ) from None
