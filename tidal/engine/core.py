"""EngineCore: one synchronous step of continuous batching: schedule -> execute -> update."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tidal.config.engine import EngineConfig
from tidal.engine.output import OutputState, RequestDelta, RequestOutput, make_logprobs
from tidal.engine.stats import StepStats
from tidal.kv.block_pool import num_blocks_for_budget, num_blocks_for_tokens
from tidal.kv.layout import KVLayout
from tidal.kv.manager import KVCacheManager
from tidal.loader.model_loader import LoadedModel
from tidal.quant.gguf_blocks import row_block
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams
from tidal.scheduler.output import SchedulerOutput
from tidal.scheduler.scheduler import Scheduler
from tidal.structured.matchers import GrammarMatchers
from tidal.worker.model_runner import ModelRunner, RunnerOutput, TokenLogprobs


@dataclass(slots=True)
class _Parent:
    """A user request; n > 1 is fanned out into n child requests that share the prompt's KV."""

    request_id: str
    prompt: str | None
    delta: bool
    children: list[OutputState] = field(default_factory=list)
    sent_first_token: bool = False  # delta: the first choice's first token has been returned

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class EngineCore:
    """Owns the scheduler, the KV manager, the model runner and every request's output state.

    `add_request` queues work; each `step` runs one batch and returns the outputs that changed:
    a full `RequestOutput` per request, or (`delta=True`) a `RequestDelta` of what is new.
    The offline `LLM` and the engine loop (engine/loop.py) both drive this one class.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        tokenizer,  # tidal.loader.tokenizer.Tokenizer, or a decode-only TokenDecoder
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[StepStats], None] | None = None,
        make_executor: Callable[..., ModelRunner] | None = None,
    ) -> None:
        """`make_executor(loaded, layout, num_blocks, kv_dtype)` builds what runs each step:
        ModelRunner in this process (the default), or a tensor-parallel group's executor
        (tidal.executor.mp), which has the same execute/release methods."""
        self.config = config
        self.loaded = loaded
        self.tokenizer = tokenizer
        self.clock = clock
        self.on_step = on_step
        arch = loaded.arch
        self.max_model_len = min(
            config.model.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
        )
        kv_dtype = loaded.dtype
        self.layout = KVLayout.from_layer_windows(
            arch.layer_windows(),
            block_size=config.cache.block_size,
            num_kv_heads=arch.kv_cache_heads,
            head_dim=arch.kv_cache_head_dim,
            parts=arch.kv_cache_parts,
            dtype_bytes=kv_dtype.itemsize,
            kv_dtype=config.cache.kv_cache_dtype,
        )
        if config.cache.kv_cache_tokens is not None:
            self.num_blocks = num_blocks_for_tokens(
                self.layout,
                config.cache.kv_cache_tokens,
                config.scheduler.max_num_seqs,
                self._max_step_tokens(),
            )
        else:
            self.num_blocks = num_blocks_for_budget(
                self.layout, self._kv_budget_bytes(loaded.device)
            )
        self.kv = KVCacheManager(self.layout, self.num_blocks, config.cache, clock)
        on_cpu = loaded.device.type == "cpu"
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.kv,
            clock,
            on_cpu=on_cpu,
            row_block=row_block(loaded.model) if on_cpu else 1,
        )
        # NOTE: with tensor parallelism `loaded.arch` holds this rank's KV heads, so the pool is
        # sized by one rank's memory; every rank allocates the same number of blocks.
        self.runner = (make_executor or ModelRunner)(loaded, self.layout, self.num_blocks, kv_dtype)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(arch.eos_token_ids)
        self.runner.grammars = GrammarMatchers(tokenizer, arch.vocab_size, self.eos_token_ids)
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}
        self.last_stats: StepStats | None = None

    # ---- sizing -------------------------------------------------------------------------------

    def _max_step_tokens(self) -> int:
        """The most tokens one step computes (what sliding-window groups must hold beyond their
        windows): the budget's ceiling, or every sequence's one decode in a decode-only step;
        with chunking off a prompt that exceeds the budget runs whole, alone."""
        sched = self.config.scheduler
        tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs)
        if not sched.enable_chunked_prefill:
            tokens = max(tokens, self.max_model_len - 1)
        return tokens

    def _kv_budget_bytes(self, device: torch.device) -> int:
        cache = self.config.cache
        if cache.kv_cache_bytes is not None:
            return cache.kv_cache_bytes
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * cache.memory_fraction)
        import psutil

        return int(
            min(cache.max_cpu_kv_bytes, psutil.virtual_memory().available * cache.memory_fraction)
        )

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        queue_timeout_s: float | None = None,
        timeout_s: float | None = None,
        delta: bool = False,
    ) -> bool:
        """Queue a request; False when the waiting queue is full (it is then finished "rejected").

        Raises ValueError for input the engine can never serve (an empty or over-long prompt,
        token ids outside the vocabulary, a timeout that is not a positive number)."""
        if request_id in self._parents:
            raise ValueError(f"request_id={request_id!r} is invalid: it is already in use")
        for name, value in (("queue_timeout_s", queue_timeout_s), ("timeout_s", timeout_s)):
            # `not > 0` also rejects NaN, which would never compare past a deadline.
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if value is not None and not ok:
                raise ValueError(
                    f"{name}={value!r} is invalid: expected a positive number of seconds or None"
                )
        prompt_token_ids = _token_ids(prompt_token_ids, self.loaded.arch.vocab_size)
        bad_bias = [t for t in params.logit_bias or {} if t >= self.loaded.arch.vocab_size]
        if bad_bias:
            raise ValueError(
                f"logit_bias={{{bad_bias[0]}: ...}} is invalid: expected token ids in "
                f"[0, {self.loaded.arch.vocab_size})"
            )
        if params.structured_outputs is not None and self.runner.grammars is not None:
            self.runner.grammars.check(params.structured_outputs)  # ValueError naming the problem
        if not prompt_token_ids:
            raise ValueError("prompt is empty: expected at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens: expected fewer than the context "
                f"length {self.max_model_len}"
            )
        now = self.clock()
        parent = _Parent(request_id, prompt, delta)
        accepted = True
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = _replace(params, n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=child_params,
                arrival_time_s=now,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                session_id=session_id,
                queue_deadline_s=None if queue_timeout_s is None else now + queue_timeout_s,
                deadline_s=None if timeout_s is None else now + timeout_s,
                max_model_len=self.max_model_len,
            )
            parent.children.append(
                OutputState(req, self.tokenizer, prompt, index=i, clock=self.clock)
            )
            self._child_parent[child_id] = request_id
            accepted = self.scheduler.add_request(req) and accepted
        self._parents[request_id] = parent
        if not accepted:
            self.abort(request_id, RequestStatus.FINISHED_REJECTED)
        return accepted

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finish a request now and free its KV; unknown ids are ignored."""
        parent = self._parents.get(request_id)
        if parent is None:
            return
        for child in parent.children:
            self.scheduler.finish_requests([child.request.request_id], status)
            child.finish(status)
            child.request.status = status
        self._forget(parent)

    def shutdown(self) -> None:
        """Stop what runs the steps (a tensor-parallel group's worker ranks); idempotent."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | RequestDelta]:
        """Run one batch; returns an output for every request that changed (finished ones last)."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        touched: dict[str, _Parent] = {}
        for req in sched.finished:  # deadlines, rejections, requests that can never fit
            parent = self._parent_of(req.request_id)
            if parent is not None:
                self._state(parent, req.request_id).finish(req.status)
                touched[parent.request_id] = parent
        result = self.runner.execute(sched)
        self._update(sched, result, touched)
        outputs = [out for p in touched.values() if (out := self._output(p)) is not None]
        for parent in touched.values():
            if parent.finished:
                self._forget(parent)
        step_s = time.perf_counter() - start
        self.scheduler.record_step(sched, step_s)
        self.last_stats = StepStats.from_step(
            self.scheduler.stats,
            sched,
            step_s,
            self.kv,
            result.moe_expert_tokens,
            num_constrained_seqs=result.num_constrained,
            grammar_mask_s=result.grammar_mask_s,
            num_draft_tokens=result.num_draft_tokens,
            num_accepted_tokens=result.num_accepted_tokens,
        )
        if self.on_step is not None:
            self.on_step(self.last_stats)
        return outputs

    def _update(
        self, sched: SchedulerOutput, result: RunnerOutput, touched: dict[str, _Parent]
    ) -> None:
        now = self.clock()
        for sr in sched.scheduled:
            req = sr.request
            parent = self._parent_of(req.request_id)
            if parent is None:
                continue
            state = self._state(parent, req.request_id)
            prompt_lp = result.prompt_logprobs.get(req.request_id)
            if prompt_lp and self._add_prompt_logprobs(state, prompt_lp):
                touched[parent.request_id] = parent
            tokens = result.sampled.get(req.request_id)
            if tokens is None or req.is_finished:
                continue
            if req.first_token_time_s is None:
                req.first_token_time_s = now
            lps = result.logprobs.get(req.request_id)
            entries = None if lps is None else [self._logprob_entry(lp) for lp in lps]
            delta = state.append(tokens, entries)
            req.output_token_ids.extend(delta.new_token_ids)
            touched[parent.request_id] = parent
            if delta.finish is not None:
                self.scheduler.finish_requests([req.request_id], delta.finish)
                req.status = delta.finish
                self.runner.release(req.request_id)
            elif sr.draft_token_ids:
                self.scheduler.keep_accepted(req)

    def _add_prompt_logprobs(
        self, state: OutputState, entries: list[tuple[int, TokenLogprobs]]
    ) -> bool:
        """Record prompt logprobs by position; True if any position was new.

        NOTE: a preempted request recomputes its prompt from position 0, so positions already
        recorded come again and are dropped (appending them duplicated the list). A position
        past the next expected one means earlier positions were never computed (a prefix-cache
        hit skipped them): those stay None so every entry remains at its own index.
        """
        if state.prompt_logprobs is None:
            return False
        next_position = len(state.prompt_logprobs)  # entry 0 (the first token) is None
        new: list = []
        for position, lp in entries:
            if position < next_position:
                continue
            new.extend([None] * (position - next_position))
            new.append(self._logprob_entry(lp))
            next_position = position + 1
        state.add_prompt_logprobs(new)
        return bool(new)

    def _logprob_entry(self, lp: TokenLogprobs) -> dict:
        return make_logprobs(
            lp.token_id, lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs, self.tokenizer
        )

    def _output(self, parent: _Parent) -> RequestOutput | RequestDelta | None:
        if parent.delta:
            return self._delta(parent)
        outs = [c.to_output() for c in parent.children]
        first = outs[0]
        if len(outs) > 1:
            first.request_id = parent.request_id
            first.outputs = [o.outputs[0] for o in outs]
            first.finished = parent.finished
        return first

    def _delta(self, parent: _Parent) -> RequestDelta | None:
        """What changed this step, or None when nothing a caller can see did (a prefill chunk
        whose prompt logprobs are not complete yet)."""
        first = parent.children[0]
        outputs = [c.take_completion() for c in parent.children]
        prompt_logprobs = first.take_prompt_logprobs()  # the choices share one prompt
        finished = parent.finished
        changed = any(o.text or o.token_ids or o.finish_reason for o in outputs)
        if not (changed or finished or prompt_logprobs is not None):
            return None
        metrics = None
        if finished or not parent.sent_first_token:
            metrics = first.metrics()
            parent.sent_first_token = metrics.first_token_time_s is not None
        req = first.request
        return RequestDelta(
            request_id=parent.request_id,
            outputs=outputs,
            finished=finished,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            metrics=metrics,
            last_token_time_s=first.last_token_time_s,
        )

    def _parent_of(self, child_id: str) -> _Parent | None:
        pid = self._child_parent.get(child_id)
        return None if pid is None else self._parents.get(pid)

    @staticmethod
    def _state(parent: _Parent, child_id: str) -> OutputState:
        return next(c for c in parent.children if c.request.request_id == child_id)

    def _forget(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._child_parent.pop(child.request.request_id, None)
            self.runner.release(child.request.request_id)


def _token_ids(token_ids: Sequence[object], vocab_size: int) -> list[int]:
    """Plain ints in [0, vocab_size), or ValueError naming the first bad entry.

    NOTE: numpy integers are accepted and turned into ints (block hashes must not depend on the
    integer type); bools, floats and strings are rejected rather than silently coerced.
    """
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError(
            f"prompt_token_ids={token_ids!r:.60} is invalid: expected a list of token ids"
        )
    out: list[int] = []
    for i, t in enumerate(token_ids):
        try:
            value = operator.index(t)  # type: ignore[arg-type]
        except TypeError:
            value = None
        if value is None or isinstance(t, bool) or not 0 <= value < vocab_size:
            raise ValueError(
                f"prompt token id {t!r} at position {i} is invalid: expected an integer in "
                f"[0, {vocab_size})"
            )
        out.append(value)
    return out


def _replace(params: SamplingParams, **changes: object) -> SamplingParams:
    from dataclasses import fields

    kwargs = {f.name: getattr(params, f.name) for f in fields(params)}
    kwargs.update(changes)
    return SamplingParams(**kwargs)
