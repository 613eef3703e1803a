"""Int8 weight-only, one scale per output channel: `Int8Linear` and the gathering `Int8Embedding`."""

from __future__ import annotations

import torch
from torch import nn

# Above this many rows the CPU kernel (a GEMV-like loop) stops beating one dequantize plus a
# float32 matmul; at 32 rows both were measured equal on Gemma 3 270M's shapes (EPYC, AVX2).
KERNEL_MAX_ROWS = 32
# Dequantize at most this many weight values at a time, so the float copy stays a few MiB.
BLOCK_VALUES = 1 << 20


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 codes (N, K) and float32 scales (N,), symmetric, w ~= code * scale."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    rows = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
    step = max(1, BLOCK_VALUES // max(1, weight.shape[1]))
    for i in range(0, rows, step):  # row blocks keep the float temporaries small (LM head: 671 MB)
        w = weight[i : i + step].float()
        s = w.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row keeps codes 0
        codes[i : i + step] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[i : i + step] = s
    return codes, scales


class Int8Linear(nn.Module):
    """y = x @ (codes * scales[:, None]).T + bias.

    On CPU with at most KERNEL_MAX_ROWS rows it runs torch's `_weight_int8pack_mm`, whose fast path
    wants bfloat16 (float16/float32 were measured 5-25x slower on AVX2): x and the raw output are
    rounded to bfloat16 there (accumulation stays float32), and the
    per-channel scales are applied afterwards in float32 rather than passed in bfloat16, where their
    rounding would bias whole output channels. Elsewhere: dequantize row blocks, float matmul."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.out_dtype = out_dtype
        self.register_buffer("codes", codes)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,) float32
        self.register_buffer("bias", bias)
        self.register_buffer(
            "unit_scales", torch.ones(codes.shape[0], dtype=torch.bfloat16, device=codes.device)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        codes, scales = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(codes, scales, bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.device.type == "cpu" and x2.shape[0] <= KERNEL_MAX_ROWS:
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.codes, self.unit_scales)
            y = y.float() * self.scales
        else:
            y = self._dequant_matmul(x2.float())
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*lead, self.out_features)

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) float32 -> (M, N) float32, one block of weight rows at a time."""
        n = self.out_features
        step = max(1, BLOCK_VALUES // self.in_features)
        if step >= n:
            return (x @ self.codes.float().t()) * self.scales
        out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
        for i in range(0, n, step):
            out[:, i : i + step] = x @ self.codes[i : i + step].float().t()
        return out.mul_(self.scales)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this module multiplies by."""
        return self.codes.float() * self.scales[:, None]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Int8Embedding(nn.Module):
    """Row lookup that dequantizes only the gathered rows; may share an Int8Linear's codes."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        self.register_buffer("codes", codes)  # (vocab, hidden) int8
        self.register_buffer("scales", scales)  # (vocab,) float32

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> Int8Embedding:
        codes, scales = quantize_rows(embedding.weight.detach())
        return cls(codes, scales, embedding.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids].float() * self.scales[ids].unsqueeze(-1)  # (..., hidden)
        return rows.to(self.out_dtype)


def quantize_linear(linear: nn.Linear) -> nn.Module:
    return Int8Linear.from_linear(linear)


def quantize_tied_embedding(head: nn.Module, embedding: nn.Embedding) -> nn.Module:
    """The tied embedding reads the head's int8 copy, so the float table can be freed."""
    assert isinstance(head, Int8Linear)
    return Int8Embedding(head.codes, head.scales, embedding.weight.dtype)
