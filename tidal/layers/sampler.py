"""Sampler: turns one step's logits into token ids (and logprobs) with per-request parameters."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tidal.kernels import sample as native_sample
from tidal.kernels.argmax import argmax_rows
from tidal.kernels.token_mask import apply_token_bitmask_
from tidal.sampling_params import SamplingParams

# The profiler region a step's sampling runs in (the model runner opens it while profiling).
SAMPLER_REGION = "tidal::sampler"
# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
_MIN_TEMPERATURE = 1e-5
# Prompt logprobs materialize a (T, V) float64 tensor; chunk T so a long prompt stays bounded
# (64 rows of a 262k vocabulary are 134 MB).
_PROMPT_CHUNK_ROWS = 64


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs about the request behind one logits row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The row's own generator (a seeded request's, made with `make_generator`); None -> the sampler's.
    generator: torch.Generator | None = None
    # The model's EOS ids; suppressed with params.stop_token_ids until min_tokens are generated.
    eos_token_ids: Collection[int] = field(default_factory=frozenset)
    # Constrained decoding: (ceil(V / 32),) int32, bit (id % 32) of word (id // 32) set where the
    # request's grammar allows token id next; None for an unconstrained row.
    grammar_bitmask: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    """One step's sampled tokens. Logprob fields are None unless some row asked for logprobs."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None = None  # (B,) float32, raw logprob of the sampled token
    ranks: torch.Tensor | None = (
        None  # (B,) int64, 1-based rank of the sampled token under raw logprobs
    )
    top_ids: torch.Tensor | None = None  # (B, K) int64, K = max logprobs asked over rows
    top_logprobs: torch.Tensor | None = None  # (B, K) float32


class PromptLogprobs(NamedTuple):
    """Logprobs of given next tokens under (T, V) logits, plus the top-k alternatives per row."""

    target_logprobs: torch.Tensor  # (T,) float64
    top_ids: torch.Tensor  # (T, k) int64
    top_logprobs: torch.Tensor  # (T, k) float64
    target_ranks: torch.Tensor  # (T,) int64, 1-based


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, for one request's sampling noise."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> PromptLogprobs:
    """Raw log-softmax logprobs of `target_ids` under `logits` (T, V) and the top-k per row.

    In float64: the accuracy gate's perplexity is exp of the mean of thousands of these, and a
    float32 log-softmax over a large vocabulary moves it in its fourth printed decimal."""
    targets, tops, top_vals, ranks = [], [], [], []
    for start in range(0, logits.shape[0], _PROMPT_CHUNK_ROWS):
        chunk = torch.log_softmax(logits[start : start + _PROMPT_CHUNK_ROWS].double(), dim=-1)
        tgt = target_ids[start : start + _PROMPT_CHUNK_ROWS].to(chunk.device, torch.int64)
        target = chunk.gather(1, tgt[:, None]).squeeze(1)  # (t,)
        values, ids = chunk.topk(k, dim=-1)  # (t, k)
        targets.append(target)
        tops.append(ids)
        top_vals.append(values)
        ranks.append(_rank(chunk, target))
    if not targets:  # T == 0
        empty = logits.new_empty((0,), dtype=torch.float64)
        ids = torch.empty((0, k), dtype=torch.int64, device=logits.device)
        long0 = torch.empty((0,), dtype=torch.int64, device=logits.device)
        return PromptLogprobs(empty, ids, empty.new_empty((0, k)), long0)
    return PromptLogprobs(
        torch.cat(targets), torch.cat(tops), torch.cat(top_vals), torch.cat(ranks)
    )


def _rank(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    # 1 + how many tokens are strictly more likely: vLLM/OpenAI's rank of the chosen token.
    return (logprobs > chosen[:, None]).sum(dim=-1) + 1


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax documents that ties return the first maximal index, on every device; the CPU
    # kernel returns the very same index ~10x faster (0.35 ms of a Gemma 3 decode step). (B, V) -> (B,)
    fast = argmax_rows(logits)
    return logits.argmax(dim=-1) if fast is None else fast


class Sampler:
    """Batched sampling: logit bias -> penalties -> grammar mask -> min_tokens -> temperature ->
    top-k -> top-p -> min-p -> draw.

    Logprobs are the log-softmax after `logit_bias` (OpenAI reports the biased distribution) and
    before penalties, temperature and filtering, as vLLM v1 returns by default: they describe the
    model, not the sampling policy, and stay comparable across requests with different parameters.
    The grammar mask only touches the constrained rows: the others' logits stay bit-identical.

    On the CPU every row draws in the C kernel (tidal/kernels/sample.c) by the inverse CDF of one
    uniform: a seeded row's from its own generator, the others' from the sampler's. The kernel's
    result depends on the row's logits and uniform alone, so a seeded row's tokens depend only on
    its seed and its logits, never on which other rows share the batch. In torch (CUDA, or no
    kernel) a seeded row draws with the exponential race, argmax(probs / q) with q ~ Exp(1) per
    token from its own generator, for the same reason; unseeded rows by the inverse CDF.
    """

    # False: torch ops only, even where the C kernels take the logits (tests compare the two)
    use_kernels: bool = True

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} is invalid: expected an integer >= 1")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self._weights: torch.Tensor | None = None  # _draw_unseeded's scratch

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of `logits` (B, >= vocab_size); padded vocab columns are ignored."""
        if logits.shape[0] != len(rows):
            raise ValueError(
                f"logits has {logits.shape[0]} rows but {len(rows)} sampling rows given"
            )
        logits = logits[:, : self.vocab_size].float()  # (B, V)
        logits = self._apply_logit_bias(logits, rows)
        out = SamplerOutput(token_ids=torch.empty(0))
        num_logprobs = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if num_logprobs:  # of the distribution before any policy is applied
            biased = logits
            # (B,); None: torch's log_softmax
            lse = native_sample.logsumexp_rows(logits) if self.use_kernels else None
            raw = torch.log_softmax(logits, dim=-1) if lse is None else None  # (B, V)
        logits = self._apply_penalties(logits, rows)
        logits = self._apply_grammar(logits, rows)
        logits = self._suppress_stops(logits, rows)

        greedy = [r.params.temperature < _MIN_TEMPERATURE for r in rows]
        if all(greedy):
            token_ids = _greedy(logits)
        elif not any(greedy):
            token_ids = self._sample(logits, rows)
        else:
            token_ids = _greedy(logits)
            # Python-side indices: no device sync, unlike nonzero() on a mask.
            picked = [i for i, g in enumerate(greedy) if not g]
            idx = torch.tensor(picked, device=logits.device)
            sampled = self._sample(logits[idx], [rows[i] for i in picked])
            token_ids = token_ids.index_copy(0, idx, sampled)
        out.token_ids = token_ids

        if num_logprobs:
            k = max(num_logprobs)
            if raw is not None:
                out.logprobs = raw.gather(1, token_ids[:, None]).squeeze(1)
                out.ranks = _rank(raw, out.logprobs)
                out.top_logprobs, out.top_ids = raw.topk(k, dim=-1)
                return out
            # log_softmax(x) = x - lse, whose order is x's: no (B, V) tensor
            chosen = biased.gather(1, token_ids[:, None]).squeeze(1)
            out.logprobs = chosen - lse
            above = native_sample.count_greater(biased, chosen)
            out.ranks = _rank(biased, chosen) if above is None else above + 1
            top = native_sample.topk_rows(biased, k) if k else None
            values, out.top_ids = biased.topk(k, dim=-1) if top is None else top
            out.top_logprobs = values - lse[:, None]
        return out

    def _apply_logit_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # One scatter-add of (row, token, bias) triples: elementwise, so a row's biased logits
        # never depend on the other rows of the batch. Ids past the vocabulary were refused at
        # add_request; the filter keeps a padded-vocab model safe all the same.
        triples = [
            (i, token, bias)
            for i, r in enumerate(rows)
            for token, bias in (r.params.logit_bias or {}).items()
            if 0 <= token < self.vocab_size
        ]
        if not triples:
            return logits
        dev = logits.device
        row_ids = torch.tensor([t[0] for t in triples], device=dev)
        token_ids = torch.tensor([t[1] for t in triples], device=dev)
        biases = torch.tensor([t[2] for t in triples], dtype=logits.dtype, device=dev)
        return logits.index_put((row_ids, token_ids), biases, accumulate=True)

    def _apply_grammar(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        picked = [i for i, r in enumerate(rows) if r.grammar_bitmask is not None]
        if not picked:
            return logits
        masks = torch.stack([rows[i].grammar_bitmask for i in picked])  # (C, W) int32
        # NOTE: a row whose grammar allows no token at all keeps its logits (no NaN draw); the
        # engine's matcher never produces that (it always allows EOS at the end).
        logits = logits.clone()  # the caller's tensor is not ours to change
        if apply_token_bitmask_(logits, masks, picked):
            return logits
        idx = torch.tensor(picked, device=logits.device)
        masks = masks.to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((masks[:, :, None] >> shifts) & 1).reshape(len(picked), -1)  # (C, W * 32)
        allowed = allowed[:, : logits.shape[1]].bool()
        if allowed.shape[1] < logits.shape[1]:  # nothing past a narrower mask is allowed
            pad = allowed.new_zeros((len(picked), logits.shape[1] - allowed.shape[1]))
            allowed = torch.cat([allowed, pad], dim=1)
        allowed |= ~allowed.any(dim=-1, keepdim=True)  # a dead row keeps every logit
        masked = torch.where(allowed, logits[idx], float("-inf"))
        return logits.index_copy_(0, idx, masked)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        rep = [r.params.repetition_penalty for r in rows]
        pres = [r.params.presence_penalty for r in rows]
        freq = [r.params.frequency_penalty for r in rows]
        use_rep = any(p != 1.0 for p in rep)
        use_openai = any(p != 0.0 for p in pres) or any(p != 0.0 for p in freq)
        if not (use_rep or use_openai):
            return logits
        counts = self._token_counts([r.output_token_ids for r in rows], logits)  # (B, V)
        logits = logits.clone()
        if use_rep:
            # HF semantics: tokens seen in prompt or output are made less likely whatever the sign.
            seen = self._token_counts([r.prompt_token_ids for r in rows], logits) + counts > 0
            penalty = torch.tensor(rep, device=logits.device)[:, None].expand_as(logits)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        if use_openai:
            # OpenAI semantics over output tokens only: subtract presence once, frequency per count.
            pres_t = torch.tensor(pres, device=logits.device)[:, None]
            freq_t = torch.tensor(freq, device=logits.device)[:, None]
            logits = logits - pres_t * (counts > 0) - freq_t * counts
        return logits

    def _token_counts(self, ids_per_row: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        # (B, V) float32 count of each token id per row, built with one scatter_add.
        counts = torch.zeros_like(logits)
        flat = [t for ids in ids_per_row for t in ids if 0 <= t < self.vocab_size]
        if not flat:
            return counts
        row_of = [i for i, ids in enumerate(ids_per_row) for t in ids if 0 <= t < self.vocab_size]
        index = torch.tensor(row_of, device=logits.device) * logits.shape[1] + torch.tensor(
            flat, device=logits.device
        )
        counts.view(-1).scatter_add_(0, index, torch.ones_like(index, dtype=counts.dtype))
        return counts

    def _suppress_stops(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # min_tokens: a row that has not yet generated min_tokens tokens may not emit a stop token.
        pairs = []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) >= r.params.min_tokens:
                continue
            stops = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                stops.update(r.eos_token_ids)
            pairs.extend((i, t) for t in stops if 0 <= t < self.vocab_size)
        if not pairs:
            return logits
        suppressed = logits.clone()
        index = torch.tensor(pairs, device=logits.device)  # (n, 2)
        suppressed[index[:, 0], index[:, 1]] = float("-inf")
        # NOTE: a row whose every finite logit was a stop token keeps its unsuppressed logits,
        # so it still emits a real token instead of NaN probabilities.
        dead = ~torch.isfinite(suppressed.max(dim=-1).values)
        return torch.where(dead[:, None], logits, suppressed)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Draw one token per row (all rows non-greedy). (R, V) -> (R,)

        The C kernel draws where it takes the logits (CPU float32), torch elsewhere."""
        if not (self.use_kernels and native_sample.available()) or logits.is_cuda:
            return self._sample_torch(logits, rows)
        drawn = self._draw_native(logits, rows)
        return self._sample_torch(logits, rows) if drawn is None else drawn

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One float64 uniform per row: a seeded row's from its own generator (so its token
        depends on its seed and logits alone), the others' from the sampler's in one call."""
        u = torch.empty(len(rows), dtype=torch.float64)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
        for i, row in enumerate(rows):
            if row.generator is not None:
                u[i] = torch.rand(1, generator=row.generator, dtype=torch.float64)[0]
        return u

    def _draw_native(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
        """The kernel's inverse-CDF draws, None where it cannot take the logits. Rows with a
        top-k draw over the kernel's (or torch.topk's) best max(k) candidates, the others over
        the whole row: no (R, V) tensor either way, and each row's token depends on its logits
        and its uniform alone."""
        vocab = logits.shape[1]
        u = self._uniforms(rows)
        temps = [r.params.temperature for r in rows]
        top_p = [min(r.params.top_p, 1.0) for r in rows]
        min_p = [r.params.min_p for r in rows]
        ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
        token_ids = torch.empty(len(rows), dtype=torch.int64)
        whole = [j for j, k in enumerate(ks) if k == 0]
        if whole:
            got = native_sample.sample_rows(
                logits, [temps[j] for j in whole], [top_p[j] for j in whole],
                [min_p[j] for j in whole], u[whole], rows=whole,
            )  # fmt: skip
            if got is None:
                return None
            token_ids[whole] = got
        cut = [j for j, k in enumerate(ks) if k > 0]
        if cut:
            widest = max(ks[j] for j in cut)
            found = native_sample.topk_rows(logits, widest, rows=cut)
            if found is None:
                found = logits[torch.tensor(cut)].topk(widest, dim=-1)
            values, ids = found
            got = native_sample.sample_rows(
                values.contiguous(), [temps[j] for j in cut], [top_p[j] for j in cut],
                [min_p[j] for j in cut], u[cut], top_k=[ks[j] for j in cut],
            )  # fmt: skip
            if got is None:
                return None
            token_ids[cut] = ids.gather(1, got[:, None]).squeeze(1)
        return token_ids

    def _sample_torch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """_sample in torch ops, on every device."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], device=dev)[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        filtered = (
            any(0 < k < logits.shape[1] for k in top_k)
            or any(p < 1.0 for p in top_p)
            or any(p > 0.0 for p in min_p)
        )
        # With a filter: the tempered, filtered logits of each row's candidates, (R, K), at the
        # token ids `order` (None: every id in order, K = V). top-k keeps K = max(k) columns, so
        # nothing below draws over the whole vocabulary.
        cands: torch.Tensor | None = None
        order: torch.Tensor | None = None
        if filtered:
            cands = logits / temps
            if any(0 < k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
                cands, order = self._top_k_top_p(cands, top_k, top_p)
            if any(p > 0.0 for p in min_p):
                # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed.
                min_p_t = torch.tensor(min_p, device=dev)[:, None]
                cutoff = cands.max(dim=-1, keepdim=True).values + torch.log(min_p_t)
                cands = cands.masked_fill(cands < cutoff, float("-inf"))

        def draw(index: torch.Tensor | None) -> torch.Tensor:
            """Unseeded draws for the rows `index` (None: all)."""
            if cands is None:
                source, scale = logits, temps
            else:
                source, scale = cands, None
            if index is not None:
                source = source[index]
                scale = None if scale is None else scale[index]
            picked = self._draw_unseeded(source, scale)
            if order is None:
                return picked
            ids = order if index is None else order[index]
            return ids.gather(1, picked[:, None]).squeeze(1)

        token_ids = torch.empty(len(rows), dtype=torch.int64, device=dev)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            token_ids = draw(None)
        elif unseeded:
            idx = torch.tensor(unseeded, device=dev)
            token_ids[idx] = draw(idx)
        for i, row in enumerate(rows):
            if row.generator is None:
                continue
            if cands is None:
                row_logits = logits[i] / temps[i]
            elif order is None:
                row_logits = cands[i]
            else:
                row_logits = torch.full_like(logits[i], float("-inf")).scatter_(
                    0, order[i], cands[i]
                )
            # A row with no finite logit (the model gave -inf everywhere) becomes uniform, not NaN.
            if not torch.isfinite(row_logits.max()):
                row_logits = torch.zeros_like(row_logits)
            probs = torch.softmax(row_logits, dim=-1)
            # Exponential race with V draws from the row's own generator every step: only
            # elementwise work on the row, so the token cannot depend on the rest of the batch.
            noise = torch.empty_like(probs).exponential_(generator=row.generator)
            # NOTE: exponential_ may return 0; clamping keeps p / q finite (0 / q == 0 for masked p).
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)
            token_ids[i] = (probs / noise).argmax()
        return token_ids

    def _draw_unseeded(self, logits: torch.Tensor, temps: torch.Tensor | None) -> torch.Tensor:
        """One token per row of softmax(logits / temps) (temps None: already divided) by the
        inverse CDF: w = exp((l - max) / T) and its running sum in one buffer kept across steps,
        then one uniform per row from the sampler's generator. A row with no finite logit draws
        uniformly.

        NOTE: softmax, cumsum and the temperature each made a fresh (R, V) tensor, 32 MiB for 32
        rows of a 262k-token vocabulary: each mapped and page-faulted afresh, so sampling 32
        rows took longer than the model's step."""
        rows, vocab = logits.shape
        peak = logits.max(dim=-1, keepdim=True).values
        dead = ~torch.isfinite(peak)
        peak = peak.masked_fill(dead, 0.0)
        w = self._weights_buffer(rows, vocab, logits)
        torch.sub(logits, peak, out=w)
        if temps is not None:
            w.div_(temps)
        w.exp_()
        if logits.device.type != "cpu" or bool(dead.any()):  # (no host sync off the CPU)
            w.masked_fill_(dead, 1.0)
        w.cumsum_(dim=-1)
        u = torch.rand(rows, 1, device=logits.device, generator=self.generator) * w[:, -1:]
        # right=True picks the first i with cdf[i] > u, so a zero-probability token never wins.
        return torch.searchsorted(w, u, right=True).squeeze(1).clamp_(max=vocab - 1)

    def _weights_buffer(self, rows: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) float32 scratch for _draw_unseeded, kept across steps (grown to the
        widest; `release()` lets it go)."""
        buf = self._weights
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab or buf.device != like.device:
            buf = self._weights = torch.empty(rows, vocab, dtype=torch.float32, device=like.device)
        return buf[:rows]

    def release(self) -> None:
        """Let the sampling scratch go (the engine idles)."""
        self._weights = None

    @staticmethod
    def _top_k_top_p(
        logits: torch.Tensor, top_k: list[int], top_p: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidates' logits (R, K), their token ids (R, K)), best first, the ones top-k and
        top-p drop at -inf.

        Works in descending-sorted space: keep the first k, then the smallest prefix whose mass
        reaches top_p (the most likely token always survives). When every row has a top_k, only
        the best max(k) candidates are sorted (topk), not the whole vocab."""
        vocab = logits.shape[1]
        dev = logits.device
        ks = [k if 0 < k < vocab else vocab for k in top_k]
        if max(ks) < vocab:
            sorted_logits, order = logits.topk(max(ks), dim=-1)  # (R, K)
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (R, V)
        k = torch.tensor(ks, device=dev)
        position = torch.arange(sorted_logits.shape[1], device=dev)[None, :]
        sorted_logits = sorted_logits.masked_fill(position >= k[:, None], float("-inf"))
        # top_p == 1 must keep everything, even where the float32 cumsum rounds up past 1.
        p = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=dev)[:, None]
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= p) & (position > 0)
        return sorted_logits.masked_fill(drop, float("-inf")), order
