"""NativeDecoder: a model's decoder layers as one C call per CPU step when their weights are GGUF
blocks (tidal/kernels/decoder.c), and the per-layer modules otherwise.

The C stack runs the functions the modules call one by one (the gemm, norm, rotary, attention and
activation kernels), in the same order, so a step gives the same bits either way; what it saves
is the Python and torch dispatch around them (~70 matmul calls, ~90 norms and their glue per
Gemma 3 270M decode step). A step takes the C path when:
- every layer is a pre-norm decoder of the Llama or Gemma 3 shape with fused q/k/v and gate/up
  GGUFLinear projections (one activation mode), float32 norm scales of one eps, and a SwiGLU or
  GeGLU MLP;
- the KV pages are a format the attention kernel reads (float32, bfloat16, int8, fp8), contiguous;
- x is CPU float32, and in the "f32" activation mode the step has at most F32_KERNEL_MAX_ROWS
  tokens (larger prefill chunks multiply decoded weight tiles with torch, as GGUFLinear does).
TIDAL_DECODER_STACK=0 turns it off (the per-layer path, for comparisons)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from tidal.attention.cpu_paged import PAGE_TYPES, QUANT_TYPES
from tidal.attention.kv_quant import QuantizedKV
from tidal.attention.metadata import AttentionMetadata
from tidal.kernels import decoder as kernel
from tidal.kernels import gguf_gemm
from tidal.quant.gguf_blocks import F32_KERNEL_MAX_ROWS, GGUFLinear

_GEMM_ACTS = {"f32": 0, "q8": 1}


def _enabled_by_env() -> bool:
    return os.environ.get("TIDAL_DECODER_STACK", "1") != "0"


class NativeDecoder:
    """Holds the decoder layers' C stack for the KV pool it was built for (rebuilt when the pool
    or the activation mode changes). `enabled` switches it off for this model."""

    def __init__(
        self, layers: nn.ModuleList, rope_types: Sequence[str], final_norm: nn.Module
    ) -> None:
        self.layers = layers
        self.rope_types = list(rope_types)
        self.final_norm = final_norm
        self.enabled = _enabled_by_env()
        self._key: tuple | None = None
        self._fast_key: tuple | None = None
        self._stack: kernel.DecoderStack | None = None
        # the final norm's float32 scale where the stack applies it (same eps), else None
        self._final_scale: torch.Tensor | None = None
        self._gemm_act = "f32"
        self.steps = 0  # steps the C stack ran (for tests and the profile)

    def reset(self) -> None:
        """Rebuild the stack at the next step (after the kernels' ISA setting changed)."""
        self._key = self._fast_key = self._stack = self._final_scale = None

    @property
    def stack(self) -> kernel.DecoderStack | None:
        return self._stack

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        kv_caches: list,
    ) -> torch.Tensor:
        """The hidden states after every layer and the final norm: one C call where `run`
        takes the step, else the layer modules one by one."""
        hidden = self.run(x, cos_sin, meta, kv_caches)
        if hidden is not None:
            return hidden
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin[layer.self_attn.layer_type], meta, kv)
        return self.final_norm(x)

    def run(
        self,
        x: torch.Tensor,
        cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        kv_caches: list,
    ) -> torch.Tensor | None:
        """Runs every layer over x in place, then the final norm, and returns the normed
        hidden states; or returns None having done nothing (the caller runs the modules). The
        final norm runs inside the same C call where its eps is the layers' (one Python call and
        allocation less a step), else as the module."""
        if not self.enabled or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if x.dim() != 2 or not x.is_contiguous() or len(meta.groups) > kernel.MAX_GROUPS:
            return None
        stack = self._stack_for(kv_caches)
        if stack is None:
            return None
        if self._gemm_act == "f32" and x.shape[0] > F32_KERNEL_MAX_ROWS:
            return None
        ropes = []
        for name in self.rope_types:
            cos, sin = cos_sin[name]
            if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
                return None
            ropes.append((cos, sin))
        groups = meta.groups
        args = (
            x,
            ropes,
            [g.slot_mapping for g in groups],
            [g.block_tables for g in groups],
            meta.seq_arrays,
        )
        final = self._final_scale
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function("tidal::decoder_stack"):
                stack.run(*args, final_norm=final)
        else:
            stack.run(*args, final_norm=final)
        self.steps += 1
        return x if final is not None else self.final_norm(x)

    def _stack_for(self, kv_caches: list) -> kernel.DecoderStack | None:
        first = self.layers[0].self_attn.qkv_proj if len(self.layers) else None
        act = first.act if isinstance(first, GGUFLinear) else None
        # Per step only the cheap check: the runner passes the same list over one pool, whose
        # layer-0 pages pin it; anything else compares every layer's pages.
        fast = (act, id(kv_caches), _pages_key(kv_caches[0]) if kv_caches else None)
        if fast == self._fast_key:
            return self._stack
        self._fast_key = fast
        key = (act, *(_pages_key(kv) for kv in kv_caches))
        if key != self._key:
            self._key = key
            self._stack = None
            if act is not None and kernel.available() and gguf_gemm.available():
                self._gemm_act = act
                self._stack = _build(self.layers, self.rope_types, kv_caches, act)
            self._final_scale = None
            if self._stack is not None and getattr(self.final_norm, "eps", None) == self._stack.eps:
                self._final_scale = _scale(self.final_norm)
        return self._stack


def _pages_key(kv: tuple) -> tuple:
    k, v = kv
    if isinstance(k, QuantizedKV):
        return (k.data.data_ptr(), v.data.data_ptr(), k.kv_dtype)
    return (k.data_ptr(), v.data_ptr(), k.dtype)


def _scale(norm: nn.Module | None) -> torch.Tensor | None:
    scale = norm.float_scale() if norm is not None else None
    if scale is not None and not (scale.is_contiguous() and scale.device.type == "cpu"):
        return None
    return scale


def _build(
    layers: nn.ModuleList, rope_types: list[str], kv_caches: list, act: str
) -> kernel.DecoderStack | None:
    """The C stack for these layers and pages, or None where some layer does not fit it."""
    specs: list[kernel.LayerSpec] = []
    eps: set[float] = set()
    mlp_acts: set[str] = set()
    shape: set[tuple[int, ...]] = set()
    for layer, kv in zip(layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        projs = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, GGUFLinear) for p in projs):
            return None
        qkv, o, gate_up, down = projs  # type: ignore[misc]
        if any(p.act != act or p.out_dtype != torch.float32 for p in projs):
            return None
        if o.bias is not None or gate_up.bias is not None or down.bias is not None:
            return None
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        if gemma:
            norms = (layer.input_layernorm, layer.post_attention_layernorm,
                     layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)  # fmt: skip
        else:
            norms = (layer.input_layernorm, None, layer.post_attention_layernorm, None)
        scales = [_scale(n) for n in norms]
        if scales[0] is None or scales[2] is None or (gemma and None in scales):
            return None
        eps.update(n.eps for n in norms if n is not None)
        q_norm = k_norm = None
        if attn.q_norm is not None or attn.k_norm is not None:
            q_norm, k_norm = _scale(attn.q_norm), _scale(attn.k_norm)
            if q_norm is None or k_norm is None:
                return None
            eps.update((attn.q_norm.eps, attn.k_norm.eps))
        pages = _pages(kv)
        if pages is None:
            return None
        if attn.layer_type not in rope_types:
            return None
        mlp_acts.add(mlp.act_name)
        shape.add((qkv.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                   mlp.intermediate, *attn.qkv_sizes))  # fmt: skip
        specs.append(
            kernel.LayerSpec(
                qkv=(qkv.parts._desc_ptr, qkv.parts.nseg),
                qkv_bias=qkv.bias,
                o=(o.parts._desc_ptr, o.parts.nseg),
                gate_up=(gate_up.parts._desc_ptr, gate_up.parts.nseg),
                down=(down.parts._desc_ptr, down.parts.nseg),
                norm_in=scales[0],
                norm_attn_out=scales[1],
                norm_ffn_in=scales[2],
                norm_ffn_out=scales[3],
                q_norm=q_norm,
                k_norm=k_norm,
                **pages,
                group=attn.kv_group,
                rope=rope_types.index(attn.layer_type),
                window=attn.window,
                scale=attn.scale,
                softcap=attn.softcap,
                keep=(qkv.parts, o.parts, gate_up.parts, down.parts),
            )
        )
    if len(eps) != 1 or len(mlp_acts) != 1 or len(shape) != 1:
        return None
    mlp_act = mlp_acts.pop()
    hidden, heads, kv_heads, head_dim, inter, q_dim, k_dim, v_dim = shape.pop()
    if (
        mlp_act not in kernel.ACT_CODES
        or q_dim != heads * head_dim
        or k_dim != kv_heads * head_dim
        or v_dim != k_dim
        or heads % kv_heads
    ):
        return None
    for spec in specs:
        for w in (*spec.keep[0], *spec.keep[1], *spec.keep[2], *spec.keep[3]):
            if w.blocks.data_ptr() != w._args[0]:
                return None  # moved storage: the per-layer path raises its clear error
    return kernel.DecoderStack(
        specs,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        inter=inter,
        act=mlp_act,
        gemm_act=_GEMM_ACTS[act],
        gemm_isa=gguf_gemm._isa_code(None),
        eps=eps.pop(),
    )


def _pages(kv: tuple) -> dict | None:
    k, v = kv
    if isinstance(k, QuantizedKV):
        if not isinstance(v, QuantizedKV):
            return None
        kv_type = QUANT_TYPES.get(k.kv_dtype)
        tensors = (k.data, v.data, k.scale, v.scale)
    else:
        kv_type = PAGE_TYPES.get(k.dtype)
        tensors = (k, v, None, None)
    if kv_type is None or not all(
        t is None or (t.is_contiguous() and t.device.type == "cpu") for t in tensors
    ):
        return None
    return dict(
        k_pages=tensors[0], v_pages=tensors[1], k_scales=tensors[2], v_scales=tensors[3],
        kv_type=kv_type,
    )  # fmt: skip
