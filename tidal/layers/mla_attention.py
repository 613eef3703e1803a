"""Multi-head latent attention (DeepSeek V2/V3): low-rank q and kv projections, latent KV cache."""

from __future__ import annotations

import torch
from torch import nn

from tidal.attention.metadata import AttentionMetadata
from tidal.attention.mla_paged import MLAPagedAttention
from tidal.attention.torch_paged import KVPages
from tidal.config.arch import FULL, ArchConfig
from tidal.kernels.gguf_gemm import BlockSegments, BlockWeight
from tidal.layers.attention import CosSin
from tidal.layers.linear import fuse_linears
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import apply_rotary, apply_rotary_interleaved, yarn_mscale
from tidal.quant.gguf_blocks import GGUFLinear

# transformers builds DeepSeek's q_a_layernorm and kv_a_layernorm with RMSNorm's default eps,
# not config.rms_norm_eps.
_LORA_NORM_EPS = 1e-6


def mla_softmax_scale(arch: ArchConfig) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (as DeepSeek and
    transformers do: the cos/sin carry the other mscale ratio, see layers/rotary.py)."""
    assert arch.mla is not None
    scale = float(arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim) ** -0.5
    scaling = arch.rope[FULL].scaling_dict()
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    """HF parameter names (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj). The KV cache entry of each token is
    [kv_a_layernorm(c) | rope(k_pe)]; kv_b_proj is split into W_UK / W_UV once the weights are
    loaded (fuse_projections) and the attention reads the latents through them."""

    def __init__(self, arch: ArchConfig, layer_id: int, kv_group: int) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None
        self.num_heads = arch.num_heads
        self.nope, self.rope_dim, self.v_dim = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        )
        self.rank = mla.kv_lora_rank
        self.interleave = mla.rope_interleave
        self.kv_group = kv_group
        self.scale = mla_softmax_scale(arch)
        hidden, heads, bias = arch.hidden_size, arch.num_heads, arch.qkv_bias
        q_dim = heads * (self.nope + self.rope_dim)
        self.q_lora = mla.q_lora_rank is not None
        if mla.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        self.layer_type = FULL
        self.backend = MLAPagedAttention()
        # W_UK (H, nope, rank) and W_UV (H, v, rank), set by fuse_projections(); buffers, so they
        # move with the model and count in its weight bytes.
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        # The file's own blocks of W_UK[h]^T (rank, nope) and W_UV[h] (v, rank) per head, where a
        # split deepseek2 GGUF has them in a kernel-readable type (set_latent_blocks): with int8
        # activations the absorbed decode multiplies by them, all heads in one kernel call.
        self.x_proj: nn.Module | None = None  # fuse_projections(): q (or q_a) and kv_a joined
        self.x_split = (0, 0)
        self.uk_jobs: list[BlockSegments] | None = None
        self.uv_jobs: list[BlockSegments] | None = None

    def set_latent_blocks(self, kind: str, weight: BlockWeight) -> None:
        """The loader's attn_k_b ("w_uk_blocks", (H * rank, nope)) or attn_v_b ("w_uv_blocks",
        (H * v, rank)) blocks, cut per head."""
        rows = weight.rows // self.num_heads
        per_head = weight.blocks.view(self.num_heads, rows, -1)
        heads = [BlockSegments((BlockWeight(b, weight.ggml_type, rows, weight.cols),))
                 for b in per_head]  # fmt: skip
        if kind == "w_uk_blocks" and (rows, weight.cols) == (self.rank, self.nope):
            self.uk_jobs = heads
        elif kind == "w_uv_blocks" and (rows, weight.cols) == (self.v_dim, self.rank):
            self.uv_jobs = heads
        else:
            raise ValueError(f"{kind}: ({weight.rows}, {weight.cols}) does not fit this layer")

    def _latent_jobs(self) -> tuple[list[BlockSegments], list[BlockSegments]] | None:
        """Both halves' per-head blocks, where the layer's projections take int8 activations."""
        if self.uk_jobs is None or self.uv_jobs is None:
            return None
        proj = self.x_proj if self.x_proj is not None else self.kv_a_proj_with_mqa
        if not isinstance(proj, GGUFLinear) or proj.act != "q8":
            return None
        return self.uk_jobs, self.uv_jobs

    def fuse_projections(self) -> None:
        """Split kv_b_proj into dense W_UK (H, nope, rank) and W_UV (H, v, rank), kept in the
        model's float dtype (a quantization swap that runs later leaves them alone); join the
        two projections of x (q_proj or q_a_proj, and kv_a_proj_with_mqa) into one matmul where
        their weight format allows it."""
        self.w_uk, self.w_uv = self._split_kv_b()
        del self.kv_b_proj
        first = self.q_a_proj if self.q_lora else self.q_proj
        self.x_proj = fuse_linears([first, self.kv_a_proj_with_mqa])
        if self.x_proj is not None:
            self.x_split = (first.out_features, self.kv_a_proj_with_mqa.out_features)
            del self.kv_a_proj_with_mqa
            if self.q_lora:
                del self.q_a_proj
            else:
                del self.q_proj

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        proj = self.kv_b_proj
        dequantize = getattr(proj, "dequantize", None)
        weight = dequantize() if dequantize is not None else proj.weight.detach()
        w = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)  # (H, nope + v, rank)
        return w[:, : self.nope].contiguous(), w[:, self.nope :].contiguous()

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata, kv_cache: KVPages
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.x_proj is not None:  # q (or q_a) and kv_a in one matmul
            q, kv_a = self.x_proj(x).split(self.x_split, dim=-1)
        else:
            q = self.q_a_proj(x) if self.q_lora else self.q_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(num_tokens, self.num_heads, self.nope + self.rope_dim)  # (T, H, nope + rope)
        q_nope, q_pe = q.split((self.nope, self.rope_dim), dim=-1)
        c, k_pe = kv_a.split((self.rank, self.rope_dim), dim=-1)
        c = self.kv_a_layernorm(c)  # (T, rank)
        cos, sin = cos_sin
        rotate = apply_rotary_interleaved if self.interleave else apply_rotary
        q_pe = rotate(q_pe, cos, sin)  # (T, H, rope)
        k_pe = rotate(k_pe[:, None, :], cos, sin)[:, 0]  # (T, rope)
        latent = torch.cat((c, k_pe), dim=-1)  # (T, rank + rope)
        w_uk, w_uv = (self.w_uk, self.w_uv) if self.w_uk is not None else self._split_kv_b()
        out = self.backend.forward(
            q_nope, q_pe, latent, kv_cache, meta, self.kv_group, w_uk, w_uv, self.scale,
            self._latent_jobs(),
        )  # (T, H, v)  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))
