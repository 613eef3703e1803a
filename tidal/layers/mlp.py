"""The gated MLP shared by the decoder families: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.decoder import gated_act
from tidal.layers.activation import activation
from tidal.layers.linear import fuse_linears


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama, GeGLU (gelu-tanh) for Gemma."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)
        self.act_name = act
        self.intermediate = intermediate
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections()

    def fuse_projections(self) -> None:
        """One gate/up matmul per step instead of two, where the weight format allows it."""
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            del self.gate_proj, self.up_proj
            self.gate_up_proj = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            # The C activation on CPU float32: the function tidal's native decoder stack runs.
            mixed = gated_act(gate_up, self.intermediate, self.act_name)
            if mixed is not None:
                return self.down_proj(mixed)
            gate, up = gate_up.split(self.intermediate, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)
