"""Tensor-parallel wrappers: row-parallel all-reduce, vocabulary-parallel embedding and LM head.

The column-parallel projections (q/k/v, gate/up) need no wrapper: a rank's modules are built at
its shard's size (tidal.loader.shard) and their outputs stay local. What crosses ranks:
- `RowParallel` (o_proj, down_proj): each rank multiplies its input columns; one all-reduce sums
  the partial outputs, so every rank holds the whole hidden state again;
- `VocabParallelEmbedding`: each rank looks up the ids of its vocabulary range (zeros elsewhere);
  one all-reduce;
- `VocabParallelHead`: each rank scores its vocabulary rows; one all-gather of the logits.
The wrappers hold any inner module (nn.Linear, int8, GGUF blocks), so quantization swaps happen
before `parallelize`. Sums run in float32 whatever the compute dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _all_reduce(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if y.dtype != torch.float32:
        out = y.float().contiguous()
        dist.all_reduce(out, group=group)
        return out.to(y.dtype)
    y = y.contiguous()
    dist.all_reduce(y, group=group)
    return y


class RowParallel(nn.Module):
    """y = all_reduce(inner(x_shard)): the inner module holds this rank's input columns."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(self.inner(x), self.group)


class VocabParallelEmbedding(nn.Module):
    """Lookup of token ids in a table split by rows: rank r holds ids [start, stop)."""

    def __init__(
        self, inner: nn.Module, start: int, stop: int, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.inner, self.start, self.stop, self.group = inner, start, stop, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        rows = self.inner(local)  # (T, hidden)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        return _all_reduce(rows, self.group)


class VocabParallelHead(nn.Module):
    """Logits over the whole vocabulary from a head split by vocabulary rows (an all-gather)."""

    def __init__(
        self,
        inner: nn.Module,
        vocab_size: int,
        rows_per_rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.inner, self.group = inner, group
        self.vocab_size, self.rows_per_rank, self.world_size = vocab_size, rows_per_rank, world_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden).float()  # (N, rows of this rank)
        if local.shape[-1] < self.rows_per_rank:  # the last rank's range may be shorter
            local = nn.functional.pad(local, (0, self.rows_per_rank - local.shape[-1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # (N, vocab)


def parallelize(model: nn.Module, shard, group: dist.ProcessGroup | None) -> nn.Module:
    """Wrap a rank's loaded model (tidal.loader.model_loader.load_model(tensor_parallel=...))
    for its group; `shard` is its tidal.loader.shard.ShardPlan. The C decoder stack is switched
    off: it runs every layer in one call, with no place for the all-reduces between them."""
    inner = model.model
    for layer in inner.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    start, stop = shard.vocab_range
    inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens, start, stop, group)
    model.lm_head = VocabParallelHead(
        model.lm_head, shard.arch.vocab_size, shard.vocab_rows, shard.world_size, group
    )
    native = getattr(inner, "native", None)
    if native is not None:
        native.enabled = False
    return model
