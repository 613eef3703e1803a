"""ModelRunner: SchedulerOutput -> tensors -> model -> sampler -> token ids (one step)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tidal.attention.metadata import build_metadata
from tidal.kv.layout import KVLayout
from tidal.layers.moe import SparseMoE
from tidal.layers.sampler import (
    SAMPLER_REGION,
    Sampler,
    SamplerOutput,
    SamplingRow,
    make_generator,
    prompt_logprobs,
)
from tidal.loader.model_loader import LoadedModel
from tidal.request import Request
from tidal.scheduler.output import SchedulerOutput
from tidal.structured.matchers import GrammarMatchers, bitmask_words
from tidal.worker.kv_cache import allocate_kv_caches

# Scored prompt rows whose logits are computed at once (64 MiB of float32 for a 262k-token
# vocabulary); prompt_logprobs then takes them in float64.
PROMPT_LOGITS_ROWS = 64
# A seeded row's generator seed: (seed * _SEED_MIX + output index) mod 2^64 (mt19937's seeding
# scrambles neighbouring seeds into unrelated streams).
_SEED_MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of a chosen token and its top alternatives (ids and logprobs, best first)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    """Per request id: the sampled token (requests whose step reached the end of known tokens),
    its logprobs when asked, and prompt logprobs for the prompt positions computed this step."""

    # Usually one token; with drafts, the accepted ones and the model's token after them.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> [(position p, logprobs of token p given tokens < p), ...]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    # MoE models: tokens routed to each expert this step, summed over the sparse layers.
    moe_expert_tokens: tuple[int, ...] = ()

    # Constrained decoding this step: rows masked, and the seconds their masks took to compute
    # (on the mask thread, overlapped with the forward).
    num_constrained: int = 0
    grammar_mask_s: float = 0.0
    # Prompt-lookup drafts checked this step, and how many of them the model agreed with.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class StepInputs:
    """What the model needs to run one step, the same on every tensor-parallel rank (rank 0
    builds it from the SchedulerOutput; tidal.executor ships it to the others as int64s)."""

    input_ids: torch.Tensor  # (T,) int64, the batch's tokens, requests back to back
    positions: torch.Tensor  # (T,) int64
    num_tokens: list[int]  # per request, tokens computed this step
    context_lens: list[int]  # per request, start + num_tokens
    block_tables: list[list[list[int]]]  # per request, per KV group
    sample_rows: list[int]  # flat token indices whose logits are sampled, in row order
    prompt_spans: list[tuple[int, int]]  # (flat start, count) of prompt positions to score


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, layout: KVLayout, num_blocks: int, kv_dtype: torch.dtype
    ) -> None:
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = loaded.device
        self.layout = layout
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(layout, num_blocks, kv_dtype, self.device)
        self.sampler = Sampler(loaded.arch.vocab_size, self.device)
        self._moe_layers = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
        self._logits: torch.Tensor | None = None  # the sampled rows' logits buffer: _logits_out
        # Set by the engine (it has the tokenizer); None serves no constrained request.
        self.grammars: GrammarMatchers | None = None
        self._mask_pool: ThreadPoolExecutor | None = None

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        if self.grammars is not None:
            self.grammars.release(request_id)

    def _start_masks(self, constrained: list[Request]) -> Future[tuple[torch.Tensor, float]]:
        """Compute the constrained rows' bitmasks on the mask thread while the forward runs
        (llguidance releases the GIL); the future gives the (C, words) masks and their time."""
        grammars = self.grammars
        if grammars is None:
            raise ValueError("structured_outputs is not available: the engine has no grammar state")
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-grammar")
        words = bitmask_words(self.arch.vocab_size)

        def fill() -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            masks = torch.empty((len(constrained), words), dtype=torch.int32)
            for i, req in enumerate(constrained):
                spec = req.sampling_params.structured_outputs
                assert spec is not None  # only constrained requests are passed in
                grammars.fill(req.request_id, spec, req.output_token_ids, masks[i])
            return masks, time.perf_counter() - start

        return self._mask_pool.submit(fill)

    def _generator(self, seed: int | None, output_index: int) -> torch.Generator | None:
        """A seeded request's noise for its output token `output_index`: a stream of its own
        per (seed, index), so the token depends on neither the batch, nor preemption, nor how
        many draft rows a step checked before it (a stream shared across a request's rows
        would shift with each of those)."""
        if seed is None:
            return None
        return make_generator((seed * _SEED_MIX + output_index) & _U64, self.device)

    @torch.inference_mode()
    def forward(
        self,
        inputs: StepInputs,
        on_prompt_logits: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """The model over one step's tokens: the sampled rows' logits ((len(sample_rows),
        vocab) float32, None without any). The scored prompt rows' logits are computed
        PROMPT_LOGITS_ROWS at a time and handed to on_prompt_logits(span, first row, logits)
        one block at a time: a 1,000-token prompt's logits whole were 1 GiB for a 262k-token
        vocabulary.

        NOTE: with tensor parallelism every rank calls this with the same inputs: its
        collectives (all-reduces in the layers, all-gathers of logits) must come in one order."""
        meta = build_metadata(
            inputs.num_tokens,
            inputs.context_lens,
            inputs.block_tables,
            self.layout.block_size,
            self.device,
        )
        hidden = self.model(
            inputs.input_ids.to(self.device), inputs.positions.to(self.device), meta, self.kv_caches
        )
        sample = None
        if inputs.sample_rows:
            picked = hidden
            # Rows ascend without repeats, so as many rows as tokens are every row (a step of
            # decodes): no index op nor copy then.
            if len(inputs.sample_rows) != hidden.shape[0]:
                picked = hidden[torch.tensor(inputs.sample_rows, device=self.device)]
            out = self._logits_out(len(inputs.sample_rows))
            sample = self.model.compute_logits(picked, out)
        for span, (a, n) in enumerate(inputs.prompt_spans):
            for row in range(0, n, PROMPT_LOGITS_ROWS):
                end = min(n, row + PROMPT_LOGITS_ROWS)
                logits = self.model.compute_logits(hidden[a + row : a + end])
                if on_prompt_logits is not None:
                    on_prompt_logits(span, row, logits)
        return sample

    def _logits_out(self, num_rows: int) -> torch.Tensor | None:
        """Where the sampled rows' logits go: rows of one float32 buffer kept from step to step,
        on the CPU where the LM head's format writes into a buffer (GGUF blocks).

        NOTE: 32 rows of a 262,144-token vocabulary are 32 MiB, past glibc's largest mmap
        threshold: allocated afresh, every step mapped it, faulted its 8,192 pages in and
        unmapped it (the LM head took 18.3 ms instead of 12.2 ms on 32 rows, Zen 5). Nothing
        reads a step's logits after execute() returns; an empty step (the engine idles) lets
        the buffer go."""
        head = getattr(self.model, "lm_head", None)
        if self.device.type != "cpu" or not hasattr(head, "forward_into"):
            return None
        buf = self._logits
        if buf is None or buf.shape[0] < num_rows:
            buf = self._logits = torch.empty(num_rows, head.out_features, dtype=torch.float32)
        return buf[:num_rows]

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, on_inputs: Callable[[StepInputs], None] | None = None
    ) -> RunnerOutput:
        """One step; `on_inputs` sees the step's inputs before the model runs (the tensor-parallel
        executor sends them to the other ranks there)."""
        out = RunnerOutput()
        if sched.is_empty:
            self._logits = None
            self.sampler.release()
            return out
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []  # flat token index whose logits are sampled
        rows: list[SamplingRow] = []
        row_ids: list[str] = []
        prompt_rows: list[tuple[str, int, int, int]] = []  # (request id, flat start, first pos, n)
        for sr in sched.scheduled:
            req = sr.request
            end = sr.start + sr.num_tokens
            flat = len(ids)
            draft = sr.draft_token_ids
            # The known tokens, then (a decode with drafts) the guessed ones after them.
            ids.extend(req.all_token_ids[sr.start : end - len(draft)])
            ids.extend(draft)
            positions.extend(range(sr.start, end))
            if sr.want_prompt_logprobs:
                # Logits at position p predict token p + 1: prompt positions 1..P-1 get scored.
                last = min(end, req.num_prompt_tokens - 1)
                if last > sr.start:
                    prompt_rows.append((req.request_id, flat, sr.start, last - sr.start))
            if sr.sample:
                seed = req.sampling_params.seed
                # Row i samples as if the first i drafts were already the outputs (penalties,
                # min_tokens, its noise), which is what they are if the model keeps them.
                for i in range(len(draft) + 1):
                    sample_rows.append(len(ids) - 1 - len(draft) + i)
                    rows.append(
                        SamplingRow(
                            params=req.sampling_params,
                            prompt_token_ids=req.prompt_token_ids,
                            output_token_ids=req.output_token_ids + draft[:i]
                            if i
                            else req.output_token_ids,
                            generator=self._generator(seed, req.num_output_tokens + i),
                            eos_token_ids=req.eos_token_ids,
                        )
                    )
                    row_ids.append(req.request_id)
        constrained = [
            sr.request
            for sr in sched.scheduled
            if sr.sample and sr.request.sampling_params.structured_outputs is not None
        ]
        masks_future = self._start_masks(constrained) if constrained else None
        inputs = StepInputs(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            [sr.num_tokens for sr in sched.scheduled],
            [sr.start + sr.num_tokens for sr in sched.scheduled],
            [sr.block_tables for sr in sched.scheduled],
            sample_rows,
            [(flat, n) for _, flat, _, n in prompt_rows],
        )
        if on_inputs is not None:
            on_inputs(inputs)

        scored = {sr.request.request_id: sr.request for sr in sched.scheduled}

        def score_prompt(span: int, row: int, logits: torch.Tensor) -> None:
            """The prompt logprobs of one block of a span's rows (`row`: its first)."""
            rid, _, first, _ = prompt_rows[span]
            req = scored[rid]
            k = req.sampling_params.prompt_logprobs or 0
            pos = first + 1 + row  # logits at position p predict token p + 1
            targets = req.prompt_token_ids[pos : pos + logits.shape[0]]
            pl = prompt_logprobs(logits, torch.tensor(targets, device=self.device), max(k, 1))
            entries = out.prompt_logprobs.setdefault(rid, [])
            for j, token in enumerate(targets):
                entries.append(
                    (
                        pos + j,
                        TokenLogprobs(
                            token,
                            float(pl.target_logprobs[j]),
                            int(pl.target_ranks[j]),
                            pl.top_ids[j, :k].tolist(),
                            pl.top_logprobs[j, :k].tolist(),
                        ),
                    )
                )

        try:
            sample_logits = self.forward(inputs, score_prompt if prompt_rows else None)
        finally:
            masks = None if masks_future is None else masks_future.result()
        if self._moe_layers:
            counts = [m.last_expert_tokens for m in self._moe_layers]
            out.moe_expert_tokens = tuple(torch.stack(counts).sum(dim=0).tolist())
        if masks is not None:
            bitmasks, out.grammar_mask_s = masks
            out.num_constrained = len(constrained)
            which = {req.request_id: i for i, req in enumerate(constrained)}
            for row, rid in zip(rows, row_ids, strict=True):
                if rid in which:
                    row.grammar_bitmask = bitmasks[which[rid]]
        if rows:
            assert sample_logits is not None
            if torch.autograd._profiler_enabled():  # `tidal bench kernels --profile`'s row
                with torch.profiler.record_function(SAMPLER_REGION):
                    result = self.sampler(sample_logits, rows)
            else:
                result = self.sampler(sample_logits, rows)
            self._collect(sched, result, rows, out)
        return out

    @staticmethod
    def _collect(
        sched: SchedulerOutput, result: SamplerOutput, rows: list[SamplingRow], out: RunnerOutput
    ) -> None:
        """Each sampled request's tokens: its row's token, or with drafts the model's tokens
        while each equals the draft it checks, then the first that does not (or the one after
        the last draft). Row i was sampled given drafts[:i], so it counts only if those held:
        with a draft treated as a proposal of probability one, this is exact speculative
        sampling (P(accept d) = p(d); a rejection leaves a sample of p given it is not d)."""
        tokens = result.token_ids.tolist()
        i = 0
        for sr in sched.scheduled:
            if not sr.sample:
                continue
            rid, draft = sr.request.request_id, sr.draft_token_ids
            n = 1
            while n <= len(draft) and tokens[i + n - 1] == draft[n - 1]:
                n += 1
            out.sampled[rid] = tokens[i : i + n]
            out.num_draft_tokens += len(draft)
            out.num_accepted_tokens += n - 1
            k = rows[i].params.logprobs
            if k is not None and result.logprobs is not None:
                out.logprobs[rid] = [
                    TokenLogprobs(
                        tokens[j],
                        float(result.logprobs[j]),
                        int(result.ranks[j]) if result.ranks is not None else 0,
                        result.top_ids[j, :k].tolist() if result.top_ids is not None else [],
                        result.top_logprobs[j, :k].tolist()
                        if result.top_logprobs is not None
                        else [],
                    )
                    for j in range(i, i + n)
                ]
            i += len(draft) + 1
