"""Rotary position embedding (rotate-half or interleaved pairs) with Llama 3.1, linear and YaRN scaling."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from tidal.config.arch import RopeConfig


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    scaling = rope.scaling_dict()
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band
        # between them is interpolated smoothly.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(head_dim, rope.theta, scaling)
    raise ValueError(f"rope_type={kind!r} is not supported (default, linear, llama3, yarn)")


def _yarn_inv_frequencies(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: dimensions that rotate fewer than
    beta_slow times over the original context are interpolated by `factor`, those rotating more
    than beta_fast times are kept, with a linear ramp between."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other kinds)."""
    scaling = rope.scaling_dict()
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        # NOTE: computed on the CPU even while the model is built on meta: a few dozen values, and
        # the first meta op would import torch._dynamo (1-2 s of every start-up) through torch's
        # Python reference kernels.
        with torch.device("cpu"):
            self.register_buffer("inv_freq", inv_frequencies(head_dim, rope), persistent=False)
        self.scale = attention_factor(rope)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, head_dim), computed in float32 and cast like transformers does."""
        cos, sin = _cos_sin(self.inv_freq.float()[None], positions)
        return _scaled(cos[0], sin[0], self.scale, dtype)


def _cos_sin(inv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, D/2) inverse frequencies -> cos, sin (R, T, D) float32, each [i] a contiguous (T, D):
    the one formula every rotary table is computed by, alone or several together."""
    freqs = positions.float()[None, :, None] * inv[:, None, :]  # (R, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _scaled(
    cos: torch.Tensor, sin: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotary_tables(
    rotary: Mapping[str, RotaryEmbedding], positions: torch.Tensor, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every layer type's (cos, sin), each what its RotaryEmbedding returns, computed together
    where the tables share a head size: one multiply, cat, cos and sin over a (types, T, D)
    tensor instead of one of each per type (a decode step's rotary glue ~20 -> ~10 torch ops).
    Both go through _cos_sin, element by element the same operations, so the same values."""
    rots = list(rotary.items())
    if len(rots) < 2 or len({r.head_dim for _, r in rots}) != 1:
        return {t: rot(positions, dtype) for t, rot in rots}
    cos, sin = _cos_sin(torch.stack([r.inv_freq.float() for _, r in rots]), positions)
    return {t: _scaled(cos[i], sin[i], r.scale, dtype) for i, (t, r) in enumerate(rots)}


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D); cos/sin: (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D) whose rotary pairs are adjacent elements (x0, x1), (x2, x3), ...; the
    result lists the pairs' first elements, then their second ones (rotate-half layout), as
    transformers' DeepSeek does: a dot product of two rotated vectors is the same either way."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # cos/sin are cat(f, f): the first half
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
