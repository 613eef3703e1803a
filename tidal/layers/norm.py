"""RMSNorm in the two flavours checkpoints use: Llama's (w * x) and Gemma's ((1 + w) * x)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tidal.kernels.norm_rope import rms_norm


class RMSNorm(nn.Module):
    """Normalizes in float32. `gemma` scales by (1 + w) in float32 before casting back, as Gemma
    does; Llama casts the normalized value back first and then multiplies by w."""

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self._scale: torch.Tensor | None = None  # Gemma's (1 + w), see _gemma_scale
        self._scale_key: tuple | None = None

    def _gemma_scale(self) -> torch.Tensor:
        """float32 (1 + w), kept between calls while the weight is the same, unchanged tensor."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.device)
        if self._scale_key != key:
            self._scale = 1.0 + w.detach().float()
            self._scale_key = key
        return self._scale

    def float_scale(self) -> torch.Tensor | None:
        """The float32 factor applied after normalizing in float32 (Gemma's 1 + w, or w of a
        float32 model), or None where the math needs a cast in between (Llama in bf16)."""
        if self.gemma:
            return self._gemma_scale()
        return self.weight if self.weight.dtype == torch.float32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step runs ~100 norms, so per-op overhead matters: one C call on CPU float32
        # (torch's rms_norm is ~8 ops there), else one fused torch op where the result is the
        # same: Gemma's float32 (1 + w), or Llama's w on a float32 model.
        if x.dtype == torch.float32 and x.device.type == "cpu":
            scale = self.float_scale()
            out = None if scale is None else rms_norm(x, scale, self.eps)
            if out is not None:
                return out
        if self.gemma:
            normed = F.rms_norm(x.float(), self.weight.shape, self._gemma_scale(), self.eps)
            return normed.to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
