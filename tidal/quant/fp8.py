"""FP8 (e4m3) weight storage with one float32 scale per output channel, upcast for the matmul."""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.int8_gemm import fp8_gemm
from tidal.quant.int8 import KERNEL_MAX_ROWS

E4M3_MAX = 448.0
BLOCK_VALUES = 1 << 20


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> float8_e4m3fn codes (N, K) and float32 scales (N,), w ~= code * scale."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    codes = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty(n, dtype=torch.float32, device=weight.device)
    step = max(1, BLOCK_VALUES // max(1, k))
    for i in range(0, n, step):
        w = weight[i : i + step].float()
        s = w.abs().amax(dim=1) / E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes[i : i + step] = (w / s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scales[i : i + step] = s
    return codes, scales


def upcast(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32 (exact). NOTE: scalar in torch on AVX2 CPUs (~10 ns a value), so
    only the fallback and prefill-sized batches take it; decode runs tidal's C kernel, which
    converts through float16 with F16C."""
    return codes.float()


class Fp8Linear(nn.Module):
    """y = x @ (upcast(codes) * scales[:, None]).T + bias: decode-sized float32 batches on CPU in
    tidal's C kernel, else upcasting a row block at a time for a float32 matmul."""

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
        self.register_buffer("codes", codes.contiguous())  # (N, K) float8_e4m3fn
        self.register_buffer("scales", scales.float().contiguous())  # (N,) float32
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        codes, scales = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(codes, scales, bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # (M, K)
        n = self.out_features
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            y = fp8_gemm(x2, self.codes, self.scales, self.bias)
            if y is not None:
                return y.to(self.out_dtype).reshape(*lead, n)
        step = max(1, BLOCK_VALUES // self.in_features)
        if step >= n:
            y = x2 @ upcast(self.codes).t()
        else:
            y = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x2.device)
            for i in range(0, n, step):
                y[:, i : i + step] = x2 @ upcast(self.codes[i : i + step]).t()
        y = y * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*lead, n)

    def dequantize(self) -> torch.Tensor:
        return upcast(self.codes) * self.scales[:, None]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Fp8Embedding(nn.Module):
    """Row lookup into fp8 codes, upcasting only the gathered rows."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = upcast(self.codes[ids]) * self.scales[ids].unsqueeze(-1)  # (..., hidden)
        return rows.to(self.out_dtype)


def quantize_linear(linear: nn.Linear) -> nn.Module:
    return Fp8Linear.from_linear(linear)


def quantize_tied_embedding(head: nn.Module, embedding: nn.Embedding) -> nn.Module:
    if not isinstance(head, Fp8Linear):
        raise TypeError(f"a tied fp8 embedding needs an Fp8Linear head, got {type(head).__name__}")
    return Fp8Embedding(head.codes, head.scales, embedding.weight.dtype)
