"""Int4 weight-only, asymmetric in groups of 32 input values: `Int4Linear`."""

from __future__ import annotations

import torch
from torch import nn

from tidal.quant.int8 import Int8Embedding

# 32 matches the sub-blocks of GGUF's Q4_K and the blocks of Q5_0, the formats it mostly replaces.
GROUP_SIZE = 32
# torch's CPU int4 packing wants the output dimension in multiples of 16.
_CPU_ROW_MULTIPLE = 16
BLOCK_VALUES = 1 << 20


def quantize_groups(
    weight: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> codes (N, K) int32 in 0..15, scales and zeros (N, K // group) bfloat16,
    with w ~= (code - 8) * scale + zero (torch's int4 convention).

    Scale and zero are rounded to bfloat16 before the codes are chosen, so the codes fit the
    parameters the kernel will actually use."""
    if weight.dim() != 2 or weight.shape[1] % group_size != 0:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} is invalid: expected (out, in) with in a "
            f"multiple of group_size={group_size}"
        )
    n, k = weight.shape
    codes = torch.empty((n, k), dtype=torch.int32, device=weight.device)
    scales = torch.empty((n, k // group_size), dtype=torch.bfloat16, device=weight.device)
    zeros = torch.empty_like(scales)
    step = max(1, BLOCK_VALUES // k)
    for i in range(0, n, step):
        w = weight[i : i + step].float().reshape(-1, k // group_size, group_size)  # (n', G, gs)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        s = ((hi - lo) / 15.0).clamp_(min=1e-8).bfloat16()
        z = (lo + 8.0 * s.float()).bfloat16()
        q = torch.round((w - z.float()[..., None]) / s.float()[..., None] + 8.0).clamp_(0, 15)
        codes[i : i + step] = q.to(torch.int32).reshape(-1, k)
        scales[i : i + step], zeros[i : i + step] = s, z
    return codes, scales, zeros


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """Inverse of quantize_groups, float32 (N, K)."""
    n, k = codes.shape
    groups = scales.shape[1]
    q = codes.float().reshape(n, groups, k // groups)  # (N, G, gs)
    return ((q - 8.0) * scales.float()[..., None] + zeros.float()[..., None]).reshape(n, k)


class Int4Linear(nn.Module):
    """On CPU (rows a multiple of 16): torch's `_weight_int4pack_mm_for_cpu` on its packed layout,
    in bfloat16 (its only fast path on AVX2: activations and outputs are rounded to bfloat16,
    accumulation is float32; float16/float32 inputs were measured 20-40x slower). Elsewhere the codes are kept two per byte and
    dequantized in row blocks for a float matmul."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scales.shape[1]
        self.out_dtype = out_dtype
        self.use_kernel = codes.device.type == "cpu" and self.out_features % _CPU_ROW_MULTIPLE == 0
        if self.use_kernel:
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            # (G, N, 2): the kernel's layout of per-group scale and zero.
            params = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
            self.register_buffer("packed", packed)
            self.register_buffer("params", params)
        else:
            nibbles = codes.to(torch.uint8).reshape(self.out_features, -1, 2)  # (N, K/2, 2)
            self.register_buffer("packed", nibbles[..., 0] | (nibbles[..., 1] << 4))
            self.register_buffer("params", torch.stack([scales, zeros], dim=0))  # (2, N, G)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        codes, scales, zeros = quantize_groups(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(codes, scales, zeros, bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.use_kernel:
            y = torch._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.packed, self.group_size, self.params
            ).float()
        else:
            y = self._dequant_matmul(x2.float())
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*lead, self.out_features)

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        step = max(1, BLOCK_VALUES // self.in_features)
        out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
        for i in range(0, n, step):
            out[:, i : i + step] = x @ self._rows(i, i + step).t()
        return out

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        p = self.packed[start:stop]  # (n', K/2) uint8
        codes = torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)  # (n', K)
        return dequantize_groups(codes, self.params[0, start:stop], self.params[1, start:stop])

    def dequantize(self) -> torch.Tensor:
        """The weight as float32; on the CPU kernel path it comes from the kernel applied to an
        identity, so it is rounded to bfloat16 (the kernel's output dtype)."""
        if not self.use_kernel:
            return self._rows(0, self.out_features)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return (
            torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.params)
            .float()
            .t()
        )

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
            f"kernel={self.use_kernel}"
        )


def quantize_linear(linear: nn.Linear) -> nn.Module:
    if linear.in_features % GROUP_SIZE != 0:
        from tidal.quant.int8 import Int8Linear

        return Int8Linear.from_linear(linear)  # NOTE: int4 groups need in % 32 == 0
    return Int4Linear.from_linear(linear)


def quantize_tied_embedding(head: nn.Module, embedding: nn.Embedding) -> nn.Module:
    """torch's packed int4 layout cannot be gathered by row, so the lookup table becomes int8."""
    return Int8Embedding.from_embedding(embedding)
