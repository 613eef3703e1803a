"""`DecoderStack`: a whole decoder stack of GGUF-block layers as one C call per step, and
`gated_act`, the MLP activation both paths share (tidal/kernels/decoder.c)."""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tidal.kernels import paged_attention
from tidal.kernels.build import load
from tidal.kernels.gguf_gemm import SOURCES as gguf_sources
from tidal.kernels.isa import capped_isa

ACT_CODES = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}
MAX_ROPES = 4
MAX_GROUPS = 16
TIME_SLOTS = ("gemm", "attention", "norm_rope", "act_add")
_word = ctypes.c_void_p

# One layer's constants (layer_t in decoder.c), packed once per model and KV pool.
LAYER = struct.Struct(
    "<"
    "9q"  # qkv, qkv_nseg, qkv_bias, o, o_nseg, gate_up, gate_up_nseg, down, down_nseg
    "6q"  # norm_in, norm_attn_out, norm_ffn_in, norm_ffn_out, q_norm, k_norm
    "6q"  # k pages, v pages, k scales, v scales, kv type, block size
    "3q"  # group, rope, window
    "2d"  # scale, softcap
)
# One step (run_t in decoder.c).
RUN = struct.Struct(
    "<"
    "2q"  # layers, n_layers
    "5q"  # hidden, H, KVH, D, inter
    "2q"  # act, gemm act
    "d"  # eps
    "3q"  # gemm isa, isa, threads
    "2q"  # x, T
    f"{MAX_ROPES}q{MAX_ROPES}q"  # cos, sin per rotary table
    f"{MAX_GROUPS}q{MAX_GROUPS}q{MAX_GROUPS}q"  # slots, tables, table width per KV group
    "2q"  # seqs, S
    "q"  # times
    "q"  # final norm scale (0: none)
)
_ERRORS = {
    -1: "unsupported ggml type",
    -2: "bad shape",
    -3: "ISA not built",
    -4: "no memory for the quantized activations",
    -10: "no memory for the attention kernel's scratch",
    -11: "no memory for the decoder's scratch",
    -12: "bad layer block",
}


# the kernels decoder.c calls, compiled into its library
LINKED = (*gguf_sources, "paged_attention", "norm_rope")


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("decoder", link=LINKED)
    if lib is None:
        return None
    lib.tidal_decoder_best_isa.restype = ctypes.c_int
    lib.tidal_decoder_layer_size.restype = ctypes.c_int64
    lib.tidal_decoder_run_size.restype = ctypes.c_int64
    lib.tidal_decoder_run.restype = ctypes.c_int
    lib.tidal_decoder_run.argtypes = [ctypes.c_char_p]
    lib.tidal_gated_act.restype = None
    lib.tidal_gated_act.argtypes = [_word] * 8
    if lib.tidal_decoder_layer_size() != LAYER.size or lib.tidal_decoder_run_size() != RUN.size:
        raise RuntimeError("decoder.c's argument blocks do not match LAYER / RUN")
    return lib


def available() -> bool:
    return _library() is not None


@functools.cache
def default_isa() -> int:
    """The `isa` the stack passes its attention and elementwise kernels: the best path the
    library has (attention's AVX-512 where the CPU runs it, the elementwise kernels then run
    AVX2), unless TIDAL_KERNEL_ISA names a lower one. Attention takes the path it takes outside
    the stack (paged_attention.default_isa()), so a step gives the same bits either way."""
    lib = _library()
    if lib is None:
        return capped_isa(0)
    return capped_isa(max([int(lib.tidal_decoder_best_isa()), *paged_attention.isas()]))


def gated_act(gate_up: torch.Tensor, inter: int, act: str) -> torch.Tensor | None:
    """act(gate) * up for a fused (..., 2 * inter) gate/up output (gate first) -> (..., inter)
    float32, computed as decoder.c computes it; None where the kernel cannot take the input
    (the caller runs torch)."""
    lib = _library()
    code = ACT_CODES.get(act)
    if (
        lib is None
        or code is None
        or gate_up.dtype != torch.float32
        or gate_up.device.type != "cpu"
        or gate_up.shape[-1] != 2 * inter
        or gate_up.stride(-1) != 1
    ):
        return None
    x2 = gate_up.reshape(-1, 2 * inter)
    rows = x2.shape[0]
    out = torch.empty((rows, inter), dtype=torch.float32)
    ld = x2.stride(0) if rows > 1 else 2 * inter
    lib.tidal_gated_act(x2.data_ptr(), rows, inter, ld, code, out.data_ptr(), inter, default_isa())
    return out.view(*gate_up.shape[:-1], inter)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What decoder.c needs of one layer: segment descriptors are the `_desc_ptr` of prepared
    tidal.kernels.gguf_gemm.BlockSegments (kept alive by `keep`), norms are float32 scales."""

    qkv: tuple[int, int]  # (descriptor address, segment count)
    qkv_bias: torch.Tensor | None
    o: tuple[int, int]
    gate_up: tuple[int, int]
    down: tuple[int, int]
    norm_in: torch.Tensor
    norm_attn_out: torch.Tensor | None
    norm_ffn_in: torch.Tensor
    norm_ffn_out: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    kv_type: int
    group: int
    rope: int
    window: int | None
    scale: float
    softcap: float | None
    keep: tuple = ()  # objects whose memory the addresses above point into


class DecoderStack:
    """Runs `layers` (LayerSpecs, in order) over x in place in one C call per step."""

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        inter: int,
        act: str,
        gemm_act: int,
        gemm_isa: int,
        eps: float,
    ) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the decoder kernel is not available: check available()")
        if act not in ACT_CODES:
            raise ValueError(f"act {act!r}; accepted: {sorted(ACT_CODES)}")
        self._lib = lib
        self._layers = list(layers)  # keeps every tensor the packed block points into alive
        packed = bytearray()
        for spec in self._layers:
            if not 0 <= spec.rope < MAX_ROPES or not 0 <= spec.group < MAX_GROUPS:
                raise ValueError(f"rope {spec.rope} / group {spec.group} out of range")
            ptr = _ptr  # a local name: the pack below reads as a table
            packed += LAYER.pack(
                *spec.qkv, ptr(spec.qkv_bias),
                *spec.o, *spec.gate_up, *spec.down,
                ptr(spec.norm_in), ptr(spec.norm_attn_out), ptr(spec.norm_ffn_in),
                ptr(spec.norm_ffn_out), ptr(spec.q_norm), ptr(spec.k_norm),
                ptr(spec.k_pages), ptr(spec.v_pages), ptr(spec.k_scales), ptr(spec.v_scales),
                spec.kv_type, spec.k_pages.shape[1],
                spec.group, spec.rope, spec.window or 0,
                spec.scale, spec.softcap or 0.0,
            )  # fmt: skip
        self._block = ctypes.create_string_buffer(bytes(packed), len(packed))
        self._head = (
            ctypes.addressof(self._block), len(self._layers),
            hidden, heads, kv_heads, head_dim, inter,
            ACT_CODES[act], gemm_act, eps, gemm_isa, default_isa(),
        )  # fmt: skip
        self.hidden = hidden
        self.eps = eps
        self.times: list[float] | None = None  # set to [0.0] * 4 to accumulate TIME_SLOTS

    def run(
        self,
        x: torch.Tensor,  # (T, hidden) float32 contiguous, updated in place
        ropes: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per rotary table: (T, D) cos, sin
        slots: Sequence[torch.Tensor],  # per KV group: (T,) int64
        tables: Sequence[torch.Tensor],  # per KV group: (S, W) int64
        seq_arrays: torch.Tensor,  # (3, S) int32
        threads: int | None = None,
        final_norm: torch.Tensor | None = None,  # (hidden,) float32: the model's final norm
    ) -> None:
        """Contract (checked by the caller, which builds these per step): CPU contiguous tensors
        of the dtypes above, x rows = T. With `final_norm`, x ends as rms_norm(x) * final_norm
        (the stack's eps), computed as tidal.kernels.norm_rope.rms_norm computes it."""
        t = x.shape[0]
        cos = [c.data_ptr() for c, _ in ropes] + [0] * (MAX_ROPES - len(ropes))
        sin = [s.data_ptr() for _, s in ropes] + [0] * (MAX_ROPES - len(ropes))
        pad = [0] * (MAX_GROUPS - len(slots))
        times = None
        if self.times is not None:
            times = (ctypes.c_double * len(TIME_SLOTS))(*self.times)
        packed = RUN.pack(
            *self._head, threads or torch.get_num_threads(),
            x.data_ptr(), t, *cos, *sin,
            *[s.data_ptr() for s in slots], *pad,
            *[b.data_ptr() for b in tables], *pad,
            *[b.shape[1] for b in tables], *pad,
            seq_arrays.data_ptr(), seq_arrays.shape[1],
            0 if times is None else ctypes.addressof(times),
            _ptr(final_norm),
        )  # fmt: skip
        rc = self._lib.tidal_decoder_run(packed)
        if times is not None:
            self.times = list(times)
        if rc == -11 or rc == -10 or rc == -4:
            raise MemoryError(f"decoder: {_ERRORS[rc]}")
        if rc:
            raise RuntimeError(f"decoder: kernel returned {rc} ({_ERRORS.get(rc, 'unknown')})")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
