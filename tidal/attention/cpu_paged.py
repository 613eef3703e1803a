"""The CPU paged-attention backend: the C kernel where it takes the step, the reference else."""

from __future__ import annotations

import torch

from tidal.attention.kv_quant import QuantizedKV
from tidal.attention.metadata import AttentionMetadata
from tidal.attention.torch_paged import KVPages, TorchPagedAttention
from tidal.kernels import paged_attention as kernel

PAGE_TYPES = {
    torch.float32: kernel.KV_F32,
    torch.bfloat16: kernel.KV_BF16,
    torch.float16: kernel.KV_F16,
}
# Activations the kernel takes (it computes in float32; bfloat16 widens exactly)
ACT_TYPES = (torch.float32, torch.bfloat16)
QUANT_TYPES = {"int8": kernel.KV_INT8, "fp8": kernel.KV_FP8}


class CpuPagedAttention:
    """TorchPagedAttention's interface and results (to float32 rounding). On CPU, with float32 or
    bfloat16 activations and float32, bfloat16, float16 or 8-bit pages, one kernel call writes the step's
    K/V and attends every query in place, decode and mixed prefill+decode steps alike, with no
    Python loop over sequences; everything else (CUDA, other dtypes, no C compiler,
    TIDAL_KERNELS=0) runs the reference unchanged."""

    def __init__(self) -> None:
        self.reference = TorchPagedAttention()

    def forward(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, KVH, D)
        v: torch.Tensor,  # (T, KVH, D)
        k_cache: KVPages,  # (num_blocks, block_size, KVH, D)
        v_cache: KVPages,
        meta: AttentionMetadata,
        group: int,
        window: int | None,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if q.device.type == "cpu" and kernel.available():
            out = _kernel_forward(q, k, v, k_cache, v_cache, meta, group, window, scale, softcap)
            if out is not None:
                return out
        return self.reference.forward(
            q, k, v, k_cache, v_cache, meta, group, window, scale, softcap
        )


def page_args(cache: KVPages) -> tuple[int | None, torch.Tensor, torch.Tensor | None]:
    """(the kernel's page type or None where it has none, the page tensor, the 8-bit pages'
    scales or None) of one layer's cache."""
    if isinstance(cache, QuantizedKV):
        return QUANT_TYPES.get(cache.kv_dtype), cache.data, cache.scale
    return PAGE_TYPES.get(cache.dtype), cache, None


def _kernel_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVPages,
    v_cache: KVPages,
    meta: AttentionMetadata,
    group: int,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor | None:
    """The kernel's output, or None where it cannot take these inputs."""
    kv_type, k_pages, k_scales = page_args(k_cache)
    _, v_pages, v_scales = page_args(v_cache)
    dtype = q.dtype
    if kv_type is None or dtype not in ACT_TYPES:
        return None
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        return None
    if dtype != torch.float32:  # bfloat16 activations widen exactly; the kernel sums in float32
        q, k, v = q.float(), k.float(), v.float()
    tables = meta.groups[group]
    args = (
        q, k, v, k_pages, v_pages, k_scales, v_scales,
        kv_type, tables.slot_mapping, tables.block_tables, meta.seq_arrays, window, scale,
        softcap,
    )  # fmt: skip
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("tidal::paged_attention"):
            out = kernel.paged_attention(*args)
    else:
        out = kernel.paged_attention(*args)
    return out if dtype == torch.float32 else out.to(dtype)
