"""`paged_attention`: one C call per layer per step that writes the step's K/V into the pages and
attends every query to its keys in place (decode and mixed prefill+decode steps on CPU)."""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from tidal.kernels.build import cpu_flags, load
from tidal.kernels.isa import (  # noqa: F401
    ISA_AVX2,
    ISA_AVX512,
    ISA_CPU_FLAGS,
    ISA_NAMES,
    ISA_SCALAR,
    capped_isa,
)

# Page formats the kernel reads (its kv_type argument). float16 pages saturate at +-65504 on
# write, as torch_paged does.
KV_F32, KV_BF16, KV_INT8, KV_FP8, KV_F16 = 0, 1, 2, 3, 4
# Code paths (its isa argument; the codes and names above, re-exported here): scalar, AVX2 and
# AVX-512 (head dims that are a multiple of 16; others run AVX2 on it). TIDAL_KERNEL_ISA lowers
# the default (=avx2 on an AVX-512 machine runs AVX2, =scalar the portable one).

# The kernel's arguments as one block of 8-byte fields (args_t in paged_attention.c), packed in
# one C call: ctypes converts a single pointer instead of 27 arguments (~4 us saved per call).
_ARGS = struct.Struct(
    "<"
    "3q"  # q, k, v
    "3q"  # their token strides (floats)
    "q"  # out
    "4q"  # T, H, KVH, D
    "4q"  # k pages, v pages, k scales, v scales (0: none)
    "2q"  # kv type, block size
    "3q"  # slot mapping, block tables, table width
    "2q"  # seq arrays (3, S) int32, S
    "q"  # window (0: none)
    "2d"  # scale, softcap (0: none)
    "2q"  # isa, threads
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("paged_attention")
    if lib is None:
        return None
    lib.tidal_paged_attention_best_isa.restype = ctypes.c_int
    lib.tidal_paged_attention_best_isa.argtypes = []
    lib.tidal_paged_attention_args_size.restype = ctypes.c_int64
    lib.tidal_paged_attention_args_size.argtypes = []
    lib.tidal_paged_attention.restype = ctypes.c_int
    lib.tidal_paged_attention.argtypes = [ctypes.c_char_p]  # the packed _ARGS block
    if lib.tidal_paged_attention_args_size() != _ARGS.size:
        raise RuntimeError("tidal_paged_attention's argument block does not match _ARGS")
    return lib


def available() -> bool:
    return _library() is not None


@functools.cache
def isas() -> tuple[int, ...]:
    """The code paths this machine runs, the portable one first: those the library was built
    with (-march=native) whose CPU flags the machine has."""
    lib = _library()
    if lib is None:
        return ()
    flags = cpu_flags()
    built = range(lib.tidal_paged_attention_best_isa() + 1)
    names = {code: name for name, code in ISA_NAMES.items()}
    return tuple(code for code in built if ISA_CPU_FLAGS[names[code]] <= flags or not flags)


@functools.cache
def default_isa() -> int:
    """The best path the library was built with, unless TIDAL_KERNEL_ISA names a lower one."""
    return capped_isa(max(isas(), default=ISA_SCALAR))


def _token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (T, n, D) with each token's n x D block contiguous (copied if not); its token stride."""
    _, n, dim = x.shape
    if x.stride(2) != 1 or (x.stride(1) != dim and n > 1):
        x = x.contiguous()
    return x, x.stride(0)


def paged_attention(
    q: torch.Tensor,  # (T, H, D) float32
    k: torch.Tensor,  # (T, KVH, D) float32
    v: torch.Tensor,  # (T, KVH, D) float32
    k_pages: torch.Tensor,  # (num_blocks, block_size, KVH, D)
    v_pages: torch.Tensor,
    k_scales: torch.Tensor | None,  # (num_blocks, block_size, KVH) float32, 8-bit pages only
    v_scales: torch.Tensor | None,
    kv_type: int,  # KV_F32 | KV_BF16 | KV_F16 | KV_INT8 | KV_FP8
    slot_mapping: torch.Tensor,  # (T,) int64
    block_tables: torch.Tensor,  # (S, W) int64
    seq_arrays: torch.Tensor,  # (3, S) int32: query_start, query_lens, context_lens
    window: int | None,
    scale: float,
    softcap: float | None,
    isa: int | None = None,
) -> torch.Tensor:
    """Writes k/v at slot_mapping into the pages (8-bit pages quantized as
    tidal.attention.kv_quant.quantize_kv does, bit for bit), then returns (T, H, D) float32
    attention of each query over its sequence's keys lo..p read through block_tables.

    Contract, not checked here (this runs once per layer per step, so the caller's test is
    cheap): CPU tensors, the dtypes above, contiguous pages of kv_type, H % KVH == 0, every
    position below context_lens[i] mapped by sequence i's table. q, k and v may be
    token-strided views (column slices of a fused qkv output); other layouts are copied.
    Raises MemoryError when the kernel's scratch cannot be allocated; call only where
    `available()`."""
    lib = _library()
    assert lib is not None, "paged_attention called without the library: check available()"
    num_tokens, heads, dim = q.shape
    kvh = k.shape[1]
    ldq, ldk, ldv = heads * dim, kvh * dim, kvh * dim
    if not q.is_contiguous():  # (stride() costs 0.25 us a call: only where needed)
        q, ldq = _token_rows(q)
    if not k.is_contiguous():
        k, ldk = _token_rows(k)
    if not v.is_contiguous():
        v, ldv = _token_rows(v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    packed = _ARGS.pack(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), ldq, ldk, ldv, out.data_ptr(),
        num_tokens, heads, kvh, dim,
        k_pages.data_ptr(), v_pages.data_ptr(),
        0 if k_scales is None else k_scales.data_ptr(),
        0 if v_scales is None else v_scales.data_ptr(),
        kv_type, k_pages.shape[1],
        slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_arrays.data_ptr(), seq_arrays.shape[1],
        window or 0, scale, softcap or 0.0,
        default_isa() if isa is None else isa, torch.get_num_threads(),
    )  # fmt: skip
    rc = lib.tidal_paged_attention(packed)
    if rc != 0:
        raise MemoryError("paged_attention: allocating the kernel's scratch failed")
    return out
