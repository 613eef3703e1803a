"""Int8 weight-only in groups of 32 input values: `Int8Linear` and the gathering `Int8Embedding`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tidal.kernels.int8_gemm import int8_gemm

# 32 is the block of GGUF's Q8_0 and Q5_0, the formats of most of the bundled model's weights:
# a Q8_0 tensor re-quantizes to the very same codes and scales (its blocks are absmax/127 too).
GROUP_SIZE = 32
# Up to this many rows tidal's C kernel (tidal/kernels) reads each weight once for all rows;
# above it (prefill chunks) one dequantize plus a float32 matmul is faster.
KERNEL_MAX_ROWS = 32
# Dequantize at most this many weight values at a time, so the float copy stays a few MiB.
BLOCK_VALUES = 1 << 20


def group_size_for(in_features: int) -> int:
    """GROUP_SIZE where it divides the input size, else one group per row (per-channel)."""
    return GROUP_SIZE if in_features % GROUP_SIZE == 0 else in_features


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 codes (N, K) and float32 scales (N, K // group_size), symmetric:
    w ~= code * scale with each group's largest |w| at code +-127."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size} is invalid: expected a divisor of in={k}")
    groups = k // group_size
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty((n, groups), dtype=torch.float32, device=weight.device)
    step = max(1, BLOCK_VALUES // max(1, k))
    for i in range(0, n, step):  # row blocks keep the float temporaries small (LM head: 671 MB)
        w = weight[i : i + step].float().reshape(-1, groups, group_size)
        s = w.abs().amax(dim=-1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group keeps codes 0
        q = torch.round(w / s[..., None]).clamp_(-127, 127).to(torch.int8)
        codes[i : i + step] = q.reshape(-1, k)
        scales[i : i + step] = s
    return codes, scales


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output channel: codes (N, K) and scales (N,)."""
    codes, scales = quantize_groups(weight, weight.shape[-1] if weight.dim() == 2 else 1)
    return codes, scales[:, 0]


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_groups: float32 (N', K) from codes (N', K), scales (N', G)."""
    n, k = codes.shape
    g = scales.shape[1]
    return (codes.float().reshape(n, g, k // g) * scales[..., None]).reshape(n, k)


def blocked_matmul(
    x: torch.Tensor, out_features: int, rows: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """(M, K) float32 x @ W.T -> (M, N) float32, where rows(a, b) dequantizes W[a:b] to float32:
    about BLOCK_VALUES weights at a time, so the float copy stays a few MiB (LM head: 671 MB)."""
    step = max(1, BLOCK_VALUES // x.shape[1])
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for i in range(0, out_features, step):
        out[:, i : i + step] = x @ rows(i, min(i + step, out_features)).t()
    return out


class Int8Linear(nn.Module):
    """y = x @ w.T + bias with w = codes * scales per group of `group_size` inputs.

    Decode-sized batches of float32 rows on CPU run tidal's C kernel (tidal/kernels/int8_gemm.c):
    float32 accumulation, the result of a row independent of the batch around it. Larger batches,
    other dtypes and devices, or a machine without a C compiler: dequantize row blocks, then a
    float32 matmul."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scales.shape[1]
        self.out_dtype = out_dtype
        self.register_buffer("codes", codes.contiguous())  # (N, K) int8
        self.register_buffer("scales", scales.float().contiguous())  # (N, K // group) float32
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach()
        codes, scales = quantize_groups(w, group_size_for(w.shape[1]))
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(codes, scales, bias, w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        y = None
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            y = int8_gemm(x2.float(), self.codes, self.scales, self.bias)
        if y is None:
            y = self._dequant_matmul(x2.float())
            if self.bias is not None:
                y = y + self.bias
        return y.to(self.out_dtype).reshape(*lead, self.out_features)

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return blocked_matmul(
            x, self.out_features, lambda a, b: dequantize_groups(self.codes[a:b], self.scales[a:b])
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this module multiplies by."""
        return dequantize_groups(self.codes, self.scales)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
            f"bias={self.bias is not None}"
        )


class Int8Embedding(nn.Module):
    """Row lookup that dequantizes only the gathered rows; may share an Int8Linear's codes."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        if scales.dim() == 1:
            scales = scales[:, None]
        self.register_buffer("codes", codes)  # (vocab, hidden) int8
        self.register_buffer("scales", scales)  # (vocab, hidden // group) float32

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> Int8Embedding:
        w = embedding.weight.detach()
        codes, scales = quantize_groups(w, group_size_for(w.shape[1]))
        return cls(codes, scales, w.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize_groups(self.codes[flat], self.scales[flat])
        return rows.reshape(*ids.shape, -1).to(self.out_dtype)


def quantize_linear(linear: nn.Linear) -> nn.Module:
    return Int8Linear.from_linear(linear)


def quantize_tied_embedding(head: nn.Module, embedding: nn.Embedding) -> nn.Module:
    """The tied embedding reads the head's int8 copy, so the float table can be freed."""
    if not isinstance(head, Int8Linear):
        raise TypeError(
            f"a tied int8 embedding needs an Int8Linear head, got {type(head).__name__}"
        )
    return Int8Embedding(head.codes, head.scales, embedding.weight.dtype)
