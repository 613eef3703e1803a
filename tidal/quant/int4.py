"""Int4 weight-only, asymmetric in groups of 32 input values: `Int4Linear` and `Int4Embedding`."""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.int8_gemm import int4_gemm
from tidal.quant.int8 import KERNEL_MAX_ROWS, Int8Linear, blocked_matmul

# 32 matches the sub-blocks of GGUF's Q4_K (whose scale-and-min form this is) and the blocks of
# Q5_0; the C kernel is written for it.
GROUP_SIZE = 32
BLOCK_VALUES = 1 << 20


def quantize_groups(
    weight: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> codes (N, K) uint8 in 0..15, float32 scales and mins (N, K // group), with
    w ~= code * scale + min; each group's smallest and largest value are codes 0 and 15."""
    if weight.dim() != 2 or weight.shape[1] % group_size != 0:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} is invalid: expected (out, in) with in a "
            f"multiple of group_size={group_size}"
        )
    n, k = weight.shape
    groups = k // group_size
    codes = torch.empty((n, k), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((n, groups), dtype=torch.float32, device=weight.device)
    mins = torch.empty_like(scales)
    step = max(1, BLOCK_VALUES // k)
    for i in range(0, n, step):
        w = weight[i : i + step].float().reshape(-1, groups, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        s = (hi - lo) / 15.0
        s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: codes 0, w = min
        q = torch.round((w - lo[..., None]) / s[..., None]).clamp_(0, 15)
        codes[i : i + step] = q.to(torch.uint8).reshape(-1, k)
        scales[i : i + step], mins[i : i + step] = s, lo
    return codes, scales, mins


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K // 2) uint8: in each group of 32, byte j holds code j in its
    low nibble and code j + 16 in its high nibble (the C kernel's layout)."""
    n, k = codes.shape
    g = codes.to(torch.uint8).reshape(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: (N, K // 2) uint8 -> (N, K) uint8."""
    n, half = packed.shape
    g = packed.reshape(n, half // (GROUP_SIZE // 2), 1, GROUP_SIZE // 2)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(n, half * 2)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """float32 (N', K) from packed codes (N', K // 2), scales and mins (N', K // 32)."""
    q = unpack_nibbles(packed).float()
    n, k = q.shape
    q = q.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    return (q * scales[..., None] + mins[..., None]).reshape(n, k)


class Int4Linear(nn.Module):
    """y = x @ w.T + bias, w = code * scale + min per group of 32, codes two per byte.

    Decode-sized float32 batches on CPU run tidal's C kernel (tidal/kernels/int8_gemm.c);
    elsewhere row blocks are dequantized for a float32 matmul."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * 2
        self.group_size = GROUP_SIZE
        self.out_dtype = out_dtype
        self.register_buffer("packed", packed.contiguous())  # (N, K // 2) uint8
        self.register_buffer("scales", scales.float().contiguous())  # (N, K // 32)
        self.register_buffer("mins", mins.float().contiguous())  # (N, K // 32)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        w = linear.weight.detach()
        codes, scales, mins = quantize_groups(w)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(pack_nibbles(codes), scales, mins, bias, w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        y = None
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            y = int4_gemm(x2.float(), self.packed, self.scales, self.mins, self.bias)
        if y is None:
            y = self._dequant_matmul(x2.float())
            if self.bias is not None:
                y = y + self.bias
        return y.to(self.out_dtype).reshape(*lead, self.out_features)

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return blocked_matmul(
            x,
            self.out_features,
            lambda a, b: dequantize(self.packed[a:b], self.scales[a:b], self.mins[a:b]),
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this module multiplies by."""
        return dequantize(self.packed, self.scales, self.mins)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"


class Int4Embedding(nn.Module):
    """Row lookup into an Int4Linear's packed codes (the tied LM head): no second table."""

    def __init__(self, head: Int4Linear, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        self.register_buffer("packed", head.packed)
        self.register_buffer("scales", head.scales)
        self.register_buffer("mins", head.mins)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.packed[flat], self.scales[flat], self.mins[flat])
        return rows.reshape(*ids.shape, -1).to(self.out_dtype)


def quantize_linear(linear: nn.Linear) -> nn.Module:
    if linear.in_features % GROUP_SIZE != 0:
        return Int8Linear.from_linear(linear)  # NOTE: int4 groups need in % 32 == 0
    return Int4Linear.from_linear(linear)


def quantize_head(linear: nn.Linear) -> nn.Module:
    """The LM head (and the embedding tied to it) stays int8, as GGUF's Q4_K_M keeps it at
    Q8_0/Q6_K. On the bundled model (python -m tidal.bench.quant_table): perplexity +43% with
    every weight in 4 bits, +36% with the head in int8 (the blocks' Q5_0 weights lose half their
    levels in 4 bits, so int4 fails the gate there either way), and batched decode 1.2x faster."""
    return Int8Linear.from_linear(linear)


def quantize_tied_embedding(head: nn.Module, embedding: nn.Embedding) -> nn.Module:
    """The tied embedding reads the head's int4 codes, so the float table can be freed."""
    if isinstance(head, Int4Linear):
        return Int4Embedding(head, embedding.weight.dtype)
    from tidal.quant.int8 import quantize_tied_embedding as int8_tied

    return int8_tied(head, embedding)
