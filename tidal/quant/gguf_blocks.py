"""GGUF's own blocks as the in-memory weight format: `GGUFLinear` and the gathering `GGUFEmbedding`.

A GGUF checkpoint's quantized matrices (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) are
kept as the file's packed blocks, memory-mapped where the loader can, and multiplied by tidal's C
kernels (tidal/kernels/gguf_gemm.c) that read them directly, so the model costs the file's bytes.

Two activation modes:
- "f32": the kernel decodes weights in registers and multiplies float32 activations; the result is
  the float32 matmul with the dequantized weights up to summation order (the same model).
- "q8": activations are quantized per block of 32 to int8 first and the dot products are integer
  (denser, faster for many rows); it changes numbers slightly, so it is gated like int8 weights.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from tidal.kernels.gguf_gemm import (
    MAX_SEGMENTS,
    SUPPORTED_TYPES,
    BlockSegments,
    BlockWeight,
    dequantize_gather,
    dequantize_rows,
    gguf_gemm,
    gguf_gemm_panels,
)
from tidal.kernels.gguf_gemm import default_isa as gguf_default_isa
from tidal.kernels.gguf_gemm import isas as gguf_isas

ACTIVATIONS = ("f32", "q8")


def native_scheme(scheme: str, asked: str) -> str:
    """The scheme to run for `scheme` as resolved from the setting `asked`: gguf-q8 runs on
    tidal's C kernels only. Without them (no C compiler, or TIDAL_KERNELS=0) "auto" takes the
    blocks with float activations ("gguf", which the torch fallback runs) and an explicit gguf-q8
    is refused rather than served, or measured by the gate, in float."""
    if scheme != "gguf-q8":
        return scheme
    from tidal.kernels import gguf_gemm

    if gguf_gemm.available():
        return scheme
    if asked == "auto":
        return "gguf"
    raise ValueError(
        "quantization='gguf-q8' is invalid here: its int8 activations need tidal's C kernels, "
        "which did not build (no C compiler, or TIDAL_KERNELS=0); expected auto or gguf"
    )


# Rows of x up to which the kernel runs in "f32" mode; above it (prefill chunks) the prefill GEMM
# (cpu_gemm()) runs, which is faster there. "q8" runs the kernel for every
# batch: its integer dot products are the fast path for many rows too.
F32_KERNEL_MAX_ROWS = 32
# Decode at most this many weight values per tile of the prefill path (a few MiB of float32).
TILE_VALUES = 1 << 20
# With oneDNN, a whole (fused) matrix up to this many values is decoded into one buffer and
# multiplied in one call whose output is the result: no copy of each tile's output into its
# columns (7.7 ms for a 512x640 @ 640x1638 linear, 8.9 ms with that copy). 16 MiB of float32
# at most: every layer matrix of the bundled model; an LM head stays tiled.
WHOLE_VALUES = 1 << 22
# The float32 GEMM of the prefill tiles on CPU: "tidal" (gguf_gemm_panels: 16 weight rows at a
# time decoded into a panel that every 6 rows of x meet in registers; AVX2), "onednn" (torch's
# mkldnn linear on a decoded matrix) or "mkl" (torch.matmul on decoded tiles). oneDNN picks its
# kernels by the CPU's ISA; MKL's sgemm read 81-104 GFLOP/s against oneDNN's 120-171 on a 2-core
# AMD EPYC with AVX-512 (512x640 @ 640x1638, one process, interleaved), and 96 vs 126 with both
# capped at AVX2. On an AVX2-only CPU the panels outrun oneDNN (benchmarks/README.md), so they
# are the default where the block kernels' path is AVX2 (TIDAL_KERNEL_ISA=avx2 included); where
# they run AVX-512, or the portable C, oneDNN stays the default. All are float32 FMA sums: the
# same numbers up to summation order. TIDAL_CPU_GEMM selects one.
CPU_GEMMS = ("tidal", "onednn", "mkl")


def supported(ggml_type: int) -> bool:
    return int(ggml_type) in SUPPORTED_TYPES


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ bias) with W kept in GGUF blocks; W may be several matrices side by side
    (a fused q/k/v or gate/up projection whose parts can have different block types), which the
    kernel runs in one call.

    `act` is "f32" or "q8" (see the module docstring). Other devices and dtypes, and machines
    without a C compiler, decode the blocks in torch and multiply in float32."""

    def __init__(
        self,
        parts: list[BlockWeight],
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        act: str = "f32",
    ) -> None:
        super().__init__()
        if not 1 <= len(parts) <= MAX_SEGMENTS:
            raise ValueError(f"parts: {len(parts)} given; 1 to {MAX_SEGMENTS} accepted")
        if len({p.cols for p in parts}) != 1:
            raise ValueError(f"parts must share their input size; got {[p.cols for p in parts]}")
        self.parts = BlockSegments(tuple(parts))  # prepared once: one kernel call per forward
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.out_dtype = out_dtype
        self.act = act
        # Registered so that .to(), weight_bytes() and state inspection see the block bytes.
        for i, p in enumerate(parts):
            self.register_buffer(f"blocks{i}", p.blocks, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @property
    def act(self) -> str:
        return self._act

    @act.setter
    def act(self, value: str) -> None:
        if value not in ACTIVATIONS:
            raise ValueError(f"act={value!r} is invalid: expected one of {', '.join(ACTIVATIONS)}")
        self._act = value

    @classmethod
    def fuse(cls, modules: list[nn.Module]) -> GGUFLinear | None:
        """One module computing the given ones side by side, or None when they cannot be fused."""
        if not all(isinstance(m, GGUFLinear) for m in modules):
            return None
        linears: list[GGUFLinear] = modules  # type: ignore[assignment]
        parts = [p for m in linears for p in m.parts]
        if len(parts) > MAX_SEGMENTS or len({m.act for m in linears}) != 1:
            return None
        if len({m.in_features for m in linears}) != 1:
            return None
        biases = [m.bias for m in linears]
        if all(b is None for b in biases):
            bias = None
        else:
            bias = torch.cat(
                [torch.zeros(m.out_features) if b is None else b for m, b in zip(linears, biases)]
            )
        return cls(parts, bias, linears[0].out_dtype, linears[0].act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_into(x, None)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """forward(x), written into `out` (float32, (M, out_features), unit inner stride) where
        the block kernel computes it; the returned tensor is the result either way."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = None
        if self._act == "q8" or x2.shape[0] <= F32_KERNEL_MAX_ROWS:
            y = gguf_gemm(x2, self.parts, self._act, out=out)
        if y is None:
            y = self._tiled_matmul(x2)
        if self.bias is not None:
            y += self.bias
        if self.out_dtype != torch.float32:
            y = y.to(self.out_dtype)
        return y.view(*lead, self.out_features)

    def _tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill-sized product, by cpu_gemm(): tidal's panel kernel on the blocks, or row
        tiles of W decoded to float32 and multiplied by a float32 GEMM library (oneDNN, MKL), the
        float copy a few MiB at most. With oneDNN a matrix of up to WHOLE_VALUES is one tile and
        one call."""
        gemm = cpu_gemm() if x.is_cpu else "mkl"
        if gemm == "tidal":
            y = gguf_gemm_panels(x, self.parts)
            if y is not None:
                return y
            # x the panels cannot take (a non-unit inner stride): a library
            gemm = "onednn" if _onednn_linear is not None else "mkl"
        onednn = gemm == "onednn"
        if onednn:
            x = x.contiguous()
            if self.out_features * self.in_features <= WHOLE_VALUES:
                w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
                row = 0
                for part in self.parts:
                    decode_rows(part, 0, part.rows, out=w[row : row + part.rows])
                    row += part.rows
                return _onednn_linear(x, w, None, "none", [], "")
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        step = max(1, TILE_VALUES // self.in_features)
        col = 0
        for part in self.parts:
            for a in range(0, part.rows, step):
                b = min(a + step, part.rows)
                w = decode_rows(part, a, b).to(x.device)
                if onednn:
                    out[:, col + a : col + b] = _onednn_linear(x, w, None, "none", [], "")
                else:
                    torch.matmul(x, w.t(), out=out[:, col + a : col + b])
            col += part.rows
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out, in) this module multiplies by."""
        return torch.cat([decode_rows(p, 0, p.rows) for p in self.parts])

    def extra_repr(self) -> str:
        types = ",".join(str(int(p.ggml_type)) for p in self.parts)
        return (
            f"in={self.in_features}, out={self.out_features}, ggml_types={types}, "
            f"act={self._act}, bias={self.bias is not None}"
        )


class GGUFEmbedding(nn.Module):
    """Row lookup that decodes only the gathered rows of a GGUF block table (the tied LM head's
    Q8_0 table for Gemma), so no float copy of a 262k-row vocabulary exists."""

    def __init__(self, weight: BlockWeight, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_blocks = weight
        self.out_dtype = out_dtype
        self.register_buffer("blocks", weight.blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = None
        if flat.device.type == "cpu":
            rows = dequantize_gather(self.weight_blocks, flat.long())
        if rows is None:
            rows = _torch_decode(self.weight_blocks.blocks[flat.cpu()], self.weight_blocks)
            rows = rows.to(flat.device)
        return rows.reshape(*ids.shape, -1).to(self.out_dtype)


def _find_onednn_linear():
    """torch's oneDNN linear on dense float32 tensors, or None where this torch lacks it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_onednn_linear = _find_onednn_linear()


@functools.cache
def cpu_gemm() -> str:
    """The float32 GEMM the CPU prefill tiles run: env TIDAL_CPU_GEMM (read once per process),
    else oneDNN where torch has it, else MKL (torch.matmul)."""
    wanted = os.environ.get("TIDAL_CPU_GEMM", "").strip().lower()
    if wanted and wanted not in CPU_GEMMS:
        raise ValueError(
            f"TIDAL_CPU_GEMM={wanted!r} is invalid: expected one of {', '.join(CPU_GEMMS)}"
        )
    if wanted == "onednn" and _onednn_linear is None:
        raise ValueError("TIDAL_CPU_GEMM=onednn: this torch build has no oneDNN linear")
    if wanted == "tidal" and "avx2" not in gguf_isas():
        raise ValueError("TIDAL_CPU_GEMM=tidal: the block kernels' AVX2 path cannot run here")
    if wanted:
        return wanted
    if gguf_default_isa() == "avx2":  # no AVX-512 here, or TIDAL_KERNEL_ISA=avx2 asked for it
        return "tidal"
    return "onednn" if _onednn_linear is not None else "mkl"


def decode_rows(
    weight: BlockWeight, start: int, stop: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [start, stop) as float32 (stop - start, cols), written into `out` if given: the C
    decoder, else torch's."""
    rows = dequantize_rows(weight, start, stop, out=out)
    if rows is None:
        rows = _torch_decode(weight.blocks[start:stop], weight)
        if out is not None:
            rows = out.copy_(rows)
    return rows


def _torch_decode(blocks: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    from tidal.quant.gguf_dequant import dequantize

    return dequantize(blocks.contiguous(), weight.ggml_type, (blocks.shape[0], weight.cols))


def set_activations(model: nn.Module, act: str) -> int:
    """Switch every GGUFLinear of the model to activation mode `act`; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.act = act
            count += 1
    return count


def row_block(model: nn.Module) -> int:
    """The rows of x the model's weight kernels compute at once past a few: 16 where its GGUF
    layers take int8 activations on AMX tiles (a 17th row pays for a second tile's integer
    products), else 1 (each row costs about the same). DraftPlanner sizes drafts by it."""
    if not any(isinstance(m, GGUFLinear) and m.act == "q8" for m in model.modules()):
        return 1
    from tidal.kernels import gguf_gemm

    return 16 if gguf_gemm.available() and gguf_gemm.default_isa() == "amx" else 1
