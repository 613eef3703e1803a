"""SparseMoE: a router picks each token's top-k experts; each expert runs once on its tokens."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config.moe import MoEConfig
from tidal.kernels.decoder import gated_act
from tidal.kernels.gguf_gemm import gguf_gemm_jobs
from tidal.layers.mlp import GatedMLP
from tidal.quant.gguf_blocks import GGUFLinear

# An expert with this many tokens in a step or more runs in calls of its own (where AMX tiles
# pay from 6 or 12 rows of x); the others share one grouped call (tidal_gguf_gemm_jobs).
JOBS_MAX_ROWS = 6


class Router(nn.Module):
    """The gate: weight (E, hidden) and, for DeepSeek-V3, e_score_correction_bias (E,). Not an
    nn.Linear, so quantization leaves it in float32: routing decides which experts run, and a
    flipped choice changes a token's output far more than rounding a matmul does."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        if moe.score_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(moe.num_experts), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) -> (weights (T, k) float32, expert ids (T, k) int64), per token only: a
        token's choice never depends on the other tokens of the step (no capacity limit)."""
        moe = self.moe
        logits = x.float() @ self.weight.float().t()  # (T, E)
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if moe.num_groups > 1:
            grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
            if moe.score_bias:  # DeepSeek-V3: a group scores its two best experts, summed
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
            else:  # DeepSeek-V2's group_limited_greedy: its best expert
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(moe.topk_groups, dim=-1, sorted=False)[1]  # (T, G')
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
            group_mask.scatter_(1, keep, True)
            expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, moe.num_experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(moe.top_k, dim=-1, sorted=False)[1]  # (T, k)
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            denominator = weights.sum(dim=-1, keepdim=True)
            if moe.scoring == "sigmoid":
                denominator = denominator + 1e-20  # as DeepSeek-V3
            weights = weights / denominator
        return weights * moe.routed_scaling_factor, ids


class SparseMoE(nn.Module):
    """Routed experts (GatedMLPs, HF names `experts.N.gate_proj`, ...) plus optional shared
    experts that every token runs. Each expert is a GatedMLP, so its linears take the same
    fusion, quantization swap and GGUF blocks as a dense MLP's."""

    def __init__(self, hidden: int, moe: MoEConfig, act: str) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.gate = Router(hidden, moe)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, moe.intermediate_size, act) for _ in range(moe.num_experts)
        )
        self.shared_experts = (
            GatedMLP(hidden, moe.shared_intermediate_size, act)
            if moe.shared_intermediate_size
            else None
        )
        # Tokens routed to each expert in the last forward (E,) int64, for the step's MoE stats.
        self.last_expert_tokens: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden = x.shape
        weights, ids = self.gate(x)  # (T, k) each
        top_k = ids.shape[1]
        flat = ids.reshape(-1)  # (T * k,): entry j is token j // k's choice j % k
        # Group the (token, choice) pairs by expert: each expert runs once on its tokens, in
        # expert order, so a token sums its experts in the same order whatever else is in the
        # batch.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.last_expert_tokens = counts
        token_of = order // top_k  # (T * k,) token index of each sorted pair
        pair_weight = weights.reshape(-1)[order].to(x.dtype)  # (T * k,)
        n_per_expert = counts.tolist()
        y = self._blocks_forward(x, token_of, n_per_expert)
        if y is not None:  # (T * k, hidden), pairs in order: one index_add_, pairs in order
            out = torch.zeros_like(x).index_add_(0, token_of, y * pair_weight[:, None])
        else:
            out = torch.zeros_like(x)
            start = 0
            for expert_id, n in enumerate(n_per_expert):
                if n == 0:
                    continue
                rows = token_of[start : start + n]
                y = self.experts[expert_id](x[rows])  # (n, hidden)
                out.index_add_(0, rows, y * pair_weight[start : start + n, None])
                start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(num_tokens, hidden)

    def _blocks_forward(
        self, x: torch.Tensor, token_of: torch.Tensor, n_per_expert: list[int]
    ) -> torch.Tensor | None:
        """Every routed expert's output for its sorted pairs, (T * k, hidden), where the experts
        are GGUF blocks with int8 activations: the experts with few tokens (all of a decode
        step's) in one kernel call for gate/up and one for down; an expert with enough tokens for
        the tile unit in calls of its own. Bit-identical to running the experts one by one. None
        where the experts are not such blocks (the caller loops over them)."""
        experts = self._expert_blocks()
        if experts is None or x.dtype is not torch.float32 or not x.is_cpu:
            return None
        used = [(e, n) for e, n in enumerate(n_per_expert) if n]
        counts = [n for _, n in used]
        gate_ups = [experts[e][0] if n < JOBS_MAX_ROWS else None for e, n in used]
        inter = self.experts[0].intermediate
        gate_up = torch.empty((token_of.numel(), 2 * inter), dtype=torch.float32)
        if (
            gguf_gemm_jobs(x, [g and g.parts for g in gate_ups], counts, token_of, out=gate_up)
            is None
        ):
            return None
        self._run_large(used, experts, 0, x, token_of, gate_up)
        mixed = gated_act(gate_up, inter, self.experts[0].act_name)
        if mixed is None:
            return None
        pairs = torch.arange(token_of.numel())
        downs = [experts[e][1] if n < JOBS_MAX_ROWS else None for e, n in used]
        y = torch.empty((token_of.numel(), x.shape[1]), dtype=torch.float32)
        if gguf_gemm_jobs(mixed, [d and d.parts for d in downs], counts, pairs, out=y) is None:
            return None
        self._run_large(used, experts, 1, mixed, None, y)
        return y

    @staticmethod
    def _run_large(
        used: list[tuple[int, int]],
        experts: list[tuple[GGUFLinear, GGUFLinear]],
        which: int,
        x: torch.Tensor,
        rows: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """The experts with JOBS_MAX_ROWS tokens or more, each its own call (AMX tiles where
        the machine has them), into their rows of `out`; an expert's rows of x are `rows`'
        entries for its pairs, or (None) x's rows of its pairs themselves."""
        start = 0
        for e, n in used:
            if n >= JOBS_MAX_ROWS:
                part = x[start : start + n] if rows is None else x[rows[start : start + n]]
                experts[e][which].forward_into(part, out[start : start + n])
            start += n

    def _expert_blocks(self) -> list[tuple[GGUFLinear, GGUFLinear]] | None:
        """Each expert's fused gate/up and down GGUFLinear, where every expert has them with
        int8 activations, float32 outputs and no bias; else None. Found once (a decode step
        asks once a layer); set_activations switches every expert at once, so one expert's
        mode is checked each time."""
        cached = self.__dict__.get("_blocks_cache")
        if cached is not None and cached[0][0] is self.experts[0].gate_up_proj:
            return cached if cached[0][0].act == "q8" else None
        blocks = self._find_expert_blocks()
        self.__dict__["_blocks_cache"] = blocks
        return blocks

    def _find_expert_blocks(self) -> list[tuple[GGUFLinear, GGUFLinear]] | None:
        blocks = []
        for expert in self.experts:
            gate_up, down = expert.gate_up_proj, expert.down_proj
            if not (isinstance(gate_up, GGUFLinear) and isinstance(down, GGUFLinear)):
                return None
            for linear in (gate_up, down):
                if linear.act != "q8" or linear.bias is not None:
                    return None
                if linear.out_dtype is not torch.float32:
                    return None
            blocks.append((gate_up, down))
        return blocks
