"""ShardPlan: which slice of each checkpoint tensor one tensor-parallel rank holds (Megatron split).

Rank r of N holds, for every decoder layer:
- q_proj rows of query heads [r*H/N, (r+1)*H/N) (column-parallel), and their bias;
- k_proj / v_proj rows of its KV heads: KVH/N of them when N divides KVH, else the one KV head
  its query heads read (replicated on N/KVH ranks: Gemma 3 270M has 1 KV head, 4 query heads);
- o_proj columns of its query heads (row-parallel: one all-reduce of the partial sums);
- gate_proj / up_proj rows [r*I/N, (r+1)*I/N) and down_proj those columns (row-parallel);
- embed_tokens and lm_head rows of its vocabulary range [r*ceil(V/N), ...) (vocab-parallel);
- every norm whole (they are per hidden or per head_dim, tiny).
Worked example, Gemma 3 270M at N=2 (H=4, KVH=1, D=256, I=2048, V=262144): rank 1 holds q rows
[512, 1024), the whole k/v (256 rows), o columns [512, 1024), gate/up rows [1024, 2048), down
columns [1024, 2048) and vocabulary rows [131072, 262144).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tidal.config.arch import ArchConfig

if TYPE_CHECKING:
    from tidal.kernels.gguf_gemm import BlockWeight

KEY = "hardware.tensor_parallel"
_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a checkpoint tensor."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class ShardPlan:
    arch: ArchConfig  # the whole model's
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        n, a = self.world_size, self.arch
        if not 0 <= self.rank < n:
            raise ValueError(f"rank={self.rank} is invalid: expected 0..{n - 1}")

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"{KEY}={n} is invalid for this model: {what}")

        need(a.num_heads % n == 0, f"it must divide the {a.num_heads} attention heads")
        need(
            a.num_kv_heads % n == 0 or n % a.num_kv_heads == 0,
            f"it must divide, or be a multiple of, the {a.num_kv_heads} KV heads",
        )
        need(
            a.intermediate_size % n == 0,
            f"it must divide the MLP's intermediate size {a.intermediate_size}",
        )
        need(self.vocab_rows * (n - 1) < a.vocab_size, "the vocabulary is too small to split")

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def num_heads(self) -> int:
        return self.arch.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.arch.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        a, n = self.arch, self.world_size
        if a.num_kv_heads >= n:
            return self.rank * self.num_kv_heads
        # Replicated: the KV head that this rank's query heads share.
        return self.rank * self.num_heads // (a.num_heads // a.num_kv_heads)

    @property
    def vocab_rows(self) -> int:
        """Rows of the vocabulary each rank holds (the last may hold fewer)."""
        return -(-self.arch.vocab_size // self.world_size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = self.rank * self.vocab_rows
        return start, min(self.arch.vocab_size, start + self.vocab_rows)

    def local_arch(self) -> ArchConfig:
        """The architecture this rank's decoder layers are built with (its heads and MLP width;
        the vocabulary stays whole: the sampler reads gathered logits)."""
        return dataclasses.replace(
            self.arch,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.arch.intermediate_size // self.world_size,
        )

    # ---- slices --------------------------------------------------------------------------------

    def slice_of(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor `name` (HF name) this rank holds; None: all of it."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return TensorSlice(0, *self.vocab_range)
        m = _LAYER.match(name)
        if m is None:
            return None
        _, proj, kind = m.groups()
        d, r = self.arch.head_dim, self.rank
        q_rows = self.num_heads * d
        kv_rows = self.num_kv_heads * d
        inter = self.arch.intermediate_size // self.world_size
        if proj == "q_proj":
            return TensorSlice(0, r * q_rows, (r + 1) * q_rows)
        if proj in ("k_proj", "v_proj"):
            start = self.kv_head_start * d
            return TensorSlice(0, start, start + kv_rows)
        if proj in ("gate_proj", "up_proj"):
            return TensorSlice(0, r * inter, (r + 1) * inter)
        if kind == "bias":
            # A row-parallel bias would be added N times by the all-reduce.
            raise ValueError(
                f"{KEY}={self.world_size}: {name} (a row-parallel bias) is not supported"
            )
        if proj == "o_proj":
            return TensorSlice(1, r * q_rows, (r + 1) * q_rows)
        if proj == "down_proj":
            return TensorSlice(1, r * inter, (r + 1) * inter)
        return None


def slice_tensor(t: torch.Tensor, s: TensorSlice) -> torch.Tensor:
    """The slice as its own tensor (a copy, so the whole tensor it came from can be freed)."""
    return t.narrow(s.dim, s.start, s.stop - s.start).contiguous().clone()


def slice_blocks(w: BlockWeight, s: TensorSlice, name: str) -> BlockWeight:
    """Rows of a GGUF block matrix (a view of the file's bytes; a copy of a resident matrix's,
    tidal/loader/resident.py), or columns on block boundaries
    (a copy of this rank's bytes); ValueError when the column split cuts through a block."""
    from tidal.kernels.gguf_gemm import BlockWeight
    from tidal.loader.resident import is_resident, resident_copy
    from tidal.quant.gguf_types import BLOCK_SIZES, GGMLType

    if s.dim == 0:
        rows = w.blocks[s.start : s.stop]
        if is_resident(w.blocks):  # read into memory of its own: copied, so the whole can go
            rows = resident_copy(rows)
        return BlockWeight(rows, w.ggml_type, s.stop - s.start, w.cols)
    elems, nbytes = BLOCK_SIZES[GGMLType(w.ggml_type)]
    if s.start % elems or s.stop % elems:
        raise ValueError(
            f"{KEY}: {name} is stored in {GGMLType(w.ggml_type).name} blocks of {elems} "
            f"columns, and this rank's columns [{s.start}, {s.stop}) do not fall on block "
            "boundaries; choose a tensor_parallel that splits it on whole blocks"
        )
    per_row = w.blocks.view(w.rows, w.cols // elems, nbytes)  # (rows, blocks per row, bytes)
    part = per_row[:, s.start // elems : s.stop // elems].reshape(w.rows, -1).contiguous()
    return BlockWeight(part, w.ggml_type, w.rows, s.stop - s.start)
