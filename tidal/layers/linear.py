"""fuse_linears: several projections of the same input as one module (fused q/k/v, gate/up);
linear_into: a projection written into a buffer the caller keeps."""

from __future__ import annotations

import torch
from torch import nn


def fuse_linears(modules: list[nn.Module]) -> nn.Module | None:
    """A module whose output is the given modules' outputs side by side (columns in order), or
    None where their formats cannot be fused (the caller keeps them apart).

    Plain nn.Linear layers become one nn.Linear with the weights stacked; a weight format defines
    a `fuse(modules)` classmethod to join its own (tidal.quant's GGUF blocks and int8 do)."""
    if not modules:
        return None
    kind = type(modules[0])
    if any(type(m) is not kind for m in modules):
        return None
    if kind is nn.Linear:
        return _fuse_dense(modules)  # type: ignore[arg-type]
    fuse = getattr(kind, "fuse", None)
    return fuse(modules) if fuse is not None else None


def _fuse_dense(linears: list[nn.Linear]) -> nn.Linear | None:
    w0 = linears[0].weight
    if any(
        m.in_features != linears[0].in_features or m.weight.dtype != w0.dtype
        or m.weight.device != w0.device
        for m in linears
    ):  # fmt: skip
        return None
    has_bias = any(m.bias is not None for m in linears)
    out_features = sum(m.out_features for m in linears)
    with torch.device("meta"):
        fused = nn.Linear(linears[0].in_features, out_features, bias=has_bias)
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), False)
    if has_bias:
        bias = [
            m.bias.detach() if m.bias is not None else w0.new_zeros(m.out_features) for m in linears
        ]
        fused.bias = nn.Parameter(torch.cat(bias), False)
    return fused


def linear_into(module: nn.Module, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """module(x), written into `out` where the module's weight format can write into a buffer
    (a `forward_into(x, out)` method: tidal.quant's GGUF blocks); otherwise `out` is unused. The
    returned tensor is the result either way."""
    write = getattr(module, "forward_into", None) if out is not None else None
    return write(x, out) if write is not None else module(x)
