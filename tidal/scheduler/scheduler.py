"""Scheduler: which requests run each step and for how many tokens (continuous batching, no torch)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tidal.config.cache import CacheConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.kv.manager import KVCacheManager
from tidal.request import Request, RequestStatus
from tidal.scheduler.controller import MIN_PREFILL_TOKENS, BatchController, StepLoad
from tidal.scheduler.cost_model import StepShape, chunk_attended_keys
from tidal.scheduler.drafting import DraftPlanner
from tidal.scheduler.output import ScheduledRequest, SchedulerOutput
from tidal.scheduler.queue import WaitingQueue
from tidal.scheduler.stats import SchedulerStats
from tidal.scheduler.stop import check_stop


class Scheduler:
    """Iteration-level batching over a KVCacheManager.

    The scheduler advances request.num_computed_tokens when it schedules tokens (as vLLM v1
    does): after schedule(), num_computed_tokens = start + num_tokens of that step, and the
    runner must read positions from ScheduledRequest.start. The engine then either calls
    update_from_output() with the sampled tokens (appends them, checks EOS / stop ids / length,
    finishes and frees) or appends them itself and calls finish_requests() for what it finished.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        on_cpu: bool = False,
        controller: BatchController | None = None,
        row_block: int = 1,
    ) -> None:
        self.config = config
        # Sets each step's token budget and seat cap; "fixed" (max_num_batched_tokens and
        # max_num_seqs, as configured) unless a target is set or on_cpu picks the auto budget.
        self.controller = controller or BatchController(config, on_cpu)
        self.plan = self.controller.plan(StepLoad(0, 0, 0))
        self.cache_config = cache_config
        self.kv = kv
        self._clock = clock
        self._waiting = WaitingQueue(config)
        # Admission order: the newest running request is last.
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._seq: dict[str, int] = {}
        self._enqueued_s: dict[str, float] = {}
        self._next_seq = 0
        # Rejected by add_request since the last step; reported in the next output's `finished`.
        self._finished_pending: list[Request] = []
        self.num_preemptions_total = 0
        self.stats = SchedulerStats()
        # Prompt-lookup drafts for decodes (num_speculative_tokens > 0), else None.
        # row_block: the rows the weight kernels compute at once (DraftPlanner).
        self._drafter = (
            DraftPlanner(config, row_block) if config.num_speculative_tokens > 0 else None
        )

    # ---- requests in and out ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._running or len(self._waiting))

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> bool:
        """Queue a request; False (status FINISHED_REJECTED) when max_queue requests already wait.

        A rejected request is also listed in the next SchedulerOutput.finished.
        """
        if request.request_id in self._requests:
            raise ValueError(
                f"request_id={request.request_id!r} is invalid: a request with this id is unfinished"
            )
        if self.config.max_queue is not None and len(self._waiting) >= self.config.max_queue:
            request.status = RequestStatus.FINISHED_REJECTED
            self._finished_pending.append(request)
            return False
        now = self._clock()
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._seq[request.request_id] = self._next_seq
        self._enqueued_s[request.request_id] = now
        uncached = request.num_tokens - self.kv.peek_computed_tokens(request)
        self._waiting.add(request, now, self._next_seq, uncached)
        self._next_seq += 1
        return True

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; None if it is unknown or finished."""
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests the engine judged done (stop strings, errors); unknown ids are ignored."""
        if not status.finished:
            raise ValueError(f"status={status!r} is invalid: expected a FINISHED_* status")
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Append sampled tokens, finish requests on EOS / stop ids / length; returns those finished."""
        now = self._clock()
        finished: list[Request] = []
        for scheduled in output.scheduled:
            request = scheduled.request
            token_ids = sampled.get(request.request_id)
            if not token_ids or request.request_id not in self._requests:
                continue  # not sampled this step, or aborted since the step was scheduled
            if request.first_token_time_s is None:
                request.first_token_time_s = now
            for token_id in token_ids:
                request.output_token_ids.append(token_id)
                status = check_stop(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
                    break
            else:
                self.keep_accepted(request)
        return finished

    def keep_accepted(self, request: Request) -> None:
        """After a step's tokens were appended: the KV of draft tokens the model did not agree
        with is stale, so those positions are computed again (the latest token's KV never
        exists yet: it is the next step's input)."""
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self._drafter is not None:
            self._drafter.forget(request.request_id)
        self.kv.free(request)
        self._requests.pop(request.request_id, None)
        self._seq.pop(request.request_id, None)
        self._enqueued_s.pop(request.request_id, None)
        if self._waiting.remove(request.request_id) is None and request in self._running:
            self._running.remove(request)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch; see the block comment for the policy."""
        # Core idea: one step of continuous batching, counted in tokens and blocks.
        #  0. Drop cached blocks idle past their TTL; finish requests whose deadline passed.
        #     Every running request gives back the sliding-window blocks its next query cannot
        #     see, scheduled this step or not (the pool's sliding share is sized on that).
        #     The batch controller plans this step: token budget = every decode + the prefill
        #     tokens that fit the time target (BatchController), and the seat cap.
        #  1. Running requests first, decodes then prefills, each oldest first: each gets its
        #     uncomputed tokens (1 for a decode, the next chunk of an unfinished prefill) capped
        #     by the remaining budget. A decode may also check prompt-lookup drafts (which and
        #     how many: DraftPlanner, from each sequence's acceptance and the step's row cost),
        #     in budget the other decodes do not need and in free blocks only.
        #     While a waiting request outranks a running prefill (WaitingQueue order: priority,
        #     then length aged by waiting time) and a seat is free, that prefill's chunk is capped
        #     at half the prefill budget, so a long prompt cannot take every step from short
        #     ones; as it ages it outranks newcomers and the cap lifts (no starvation).
        #     When its blocks do not fit, preempt the lowest-priority, newest running request not
        #     yet scheduled this step (possibly itself: it waits for the others to finish) and
        #     retry. A request that is alone and still does not fit can never fit: FINISHED_ERROR.
        #  2. Unless someone was preempted (memory is short: admitting more would thrash), admit
        #     waiting requests in WaitingQueue order while seats, budget and blocks last, each
        #     skipping its prefix-cache hit. The first one that does not fit stops admission, so
        #     big or old requests are not overtaken forever. Chunking off: a prompt must fit the
        #     remaining budget whole, except one longer than the whole budget, which runs alone
        #     in a step of its own (the one case where num_batched_tokens > token_budget).
        #     window_ms: when nothing runs and the waiting work cannot fill a step, prefills are
        #     held until the oldest waiting request has waited window_ms (stats.hold_until_s).
        #  3. Output: decodes first, then prefill chunks in allocation order, so a request that
        #     hits a block written in this same step always comes after its writer.
        now = self._clock()
        self.kv.evict_expired()
        for request in self._running:
            self.kv.release_out_of_window(request)
        queried0, hits0 = self.kv.prefix_queried_tokens, self.kv.prefix_hit_tokens
        out = SchedulerOutput()
        out.finished.extend(self._finished_pending)
        self._finished_pending = []
        self._expire_deadlines(now, out)
        plan = self.plan = self.controller.plan(self._load(now))
        out.token_budget = plan.token_budget

        budget = plan.token_budget
        chunk_cap = max(MIN_PREFILL_TOKENS, plan.prefill_tokens // 2)
        scheduled: list[ScheduledRequest] = []
        scheduled_ids: set[str] = set()
        # Decodes before prefill chunks (each group oldest first): the budget counted every
        # decode in, and an older request's chunk must not take a decode's token.
        ordered = sorted(self._running, key=lambda r: r.num_uncomputed_tokens != 1)
        decodes_left = sum(1 for r in ordered if r.num_uncomputed_tokens == 1)
        drafts = (
            self._drafter.plan(ordered[:decodes_left], budget - decodes_left)
            if self._drafter is not None
            else {}
        )
        for request in ordered:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted or failed earlier in this loop
            if budget <= 0:
                break
            num_new = self._chunk(request.num_uncomputed_tokens, budget)
            if num_new > chunk_cap and self._outranked(request, now):
                num_new = chunk_cap
            if num_new <= 0:
                continue
            draft: list[int] = []
            tables = None
            if request.num_uncomputed_tokens == 1:
                decodes_left -= 1
                # Drafts take budget the other decodes do not need, and blocks that are free:
                # no one is preempted for a guess.
                draft = drafts.get(request.request_id, [])[: max(0, budget - 1 - decodes_left)]
                if draft:
                    tables = self.kv.allocate_slots(request, num_new + len(draft))
                    draft = draft if tables is not None else []
                if self._drafter is not None:
                    self._drafter.scheduled(request, len(draft))
            if tables is None:
                tables = self._allocate_running(request, num_new, scheduled_ids, out)
            if tables is not None:
                scheduled.append(
                    self._schedule(request, request.num_computed_tokens, num_new, tables, draft)
                )
                scheduled_ids.add(request.request_id)
                budget -= num_new + len(draft)

        hold_until_s = None
        if not out.preempted_ids and len(self._waiting):
            hold_until_s = self._hold_until(now)
            if hold_until_s is None:
                self._admit(now, budget, scheduled, out)

        decodes = [s for s in scheduled if _is_decode(s)]
        out.scheduled = decodes + [s for s in scheduled if not _is_decode(s)]
        out.num_batched_tokens = sum(s.num_tokens for s in scheduled)
        shape = _shape(out)
        self.stats = SchedulerStats(
            num_scheduled_tokens=out.num_batched_tokens,
            token_budget=out.token_budget,
            num_scheduled_seqs=len(scheduled),
            num_decode_seqs=len(decodes),
            num_prefill_seqs=len(scheduled) - len(decodes),
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_preempted=len(out.preempted_ids),
            num_finished_by_scheduler=len(out.finished),
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_queried_tokens=self.kv.prefix_queried_tokens - queried0,
            prefix_hit_tokens=self.kv.prefix_hit_tokens - hits0,
            hold_until_s=hold_until_s,
            num_preemptions_total=self.num_preemptions_total,
            seat_cap=plan.max_num_seqs,
            prefill_budget=plan.prefill_tokens,
            budget_reason=plan.reason,
            num_prefill_tokens=shape.num_prefill_tokens,
            attended_keys=shape.attended_keys,
            predicted_step_s=self.controller.model.predict_s(shape),
            cost_coefficients=tuple(self.controller.model.coefficients),
            headroom=self.controller.headroom,
        )
        return out

    def record_step(self, output: SchedulerOutput, step_s: float) -> None:
        """Feed the measured time of the step `output` described to the batch controller."""
        if output.is_empty:
            return  # bookkeeping-only steps say nothing about compute cost
        plan = self.plan
        seats_full = len(self._running) >= plan.max_num_seqs and len(self._waiting) > 0
        filled = output.num_batched_tokens >= plan.token_budget or seats_full
        self.controller.observe(_shape(output), step_s, plan, filled)

    def _load(self, now: float) -> StepLoad:
        """The controller's view of the work before this step is built."""
        decodes = [r for r in self._running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self._running if r.num_uncomputed_tokens > 1]
        decoding: list[tuple[int, float, int]] = []
        if self.config.target_tpot_ms is not None:
            for r in decodes:
                if r.first_token_time_s is None:
                    continue
                max_tokens = r.sampling_params.max_tokens
                left = (max_tokens if max_tokens is not None else 1 << 30) - r.num_output_tokens
                if r.max_model_len is not None:
                    left = min(left, r.max_model_len - r.num_tokens)
                elapsed_s = now - r.first_token_time_s
                decoding.append((r.num_output_tokens - 1, elapsed_s, left))
        pending: list[tuple[float, int]] = []
        if self.config.target_ttft_ms is not None:
            for r in self._running:
                if r.first_token_time_s is None:
                    pending.append((now - self._enqueued_s[r.request_id], r.num_uncomputed_tokens))
            for r in self._waiting.ordered(now):
                waited_s = now - self._enqueued_s[r.request_id]
                pending.append((waited_s, self._waiting.uncached(r.request_id)))
        return StepLoad(
            num_decodes=len(decodes),
            decode_keys=sum(r.num_computed_tokens + 1 for r in decodes),
            num_running=len(self._running),
            decoding=tuple(decoding),
            prefill_start=prefills[0].num_computed_tokens if prefills else 0,
            pending_first_tokens=tuple(pending),
        )

    def _outranked(self, request: Request, now: float) -> bool:
        """Whether a waiting request would be admitted before this running prefill, with a seat
        free for it (the chunk cap of step 1)."""
        if not len(self._waiting) or len(self._running) >= self.plan.max_num_seqs:
            return False
        rid = request.request_id
        return self._waiting.head_outranks(
            request, self._enqueued_s[rid], self._seq[rid], request.num_uncomputed_tokens, now
        )

    def _chunk(self, num_uncomputed: int, budget: int) -> int:
        """Tokens of a prefill that fit this step; 0 means it must wait (chunking off)."""
        if self.config.enable_chunked_prefill:
            return min(num_uncomputed, budget)
        if num_uncomputed <= budget:
            return num_uncomputed
        # Longer than the whole budget: it can only ever run alone, in a step of its own.
        alone = not self._running and budget == self.plan.token_budget
        return num_uncomputed if alone else 0

    def _allocate_running(
        self, request: Request, num_new: int, scheduled_ids: set[str], out: SchedulerOutput
    ) -> list[list[int]] | None:
        while True:
            tables = self.kv.allocate_slots(request, num_new)
            if tables is not None:
                return tables
            if len(self._running) == 1:
                # Nothing else holds blocks (waiting requests hold none), so it can never fit:
                # preempting it would only bring it back to the same failure.
                self._finish(request, RequestStatus.FINISHED_ERROR)
                out.finished.append(request)
                return None
            candidates = [r for r in self._running if r.request_id not in scheduled_ids]
            victim = min(candidates, key=lambda r: (r.priority, -self._seq[r.request_id]))
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute later: free the KV, keep the outputs (they are re-prefilled with the prompt)."""
        self.kv.free(request)
        self._running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        rid = request.request_id
        self._waiting.add_preempted(request, self._enqueued_s[rid], self._seq[rid])
        out.preempted_ids.append(rid)

    def _hold_until(self, now: float) -> float | None:
        """With window_ms, the clock time until which idle-engine prefills wait to gather more."""
        if self.config.window_ms <= 0 or self._running:
            return None
        if len(self._waiting) >= self.plan.max_num_seqs:
            return None
        if self._waiting.uncached_tokens() >= self.plan.token_budget:
            return None
        oldest_s = self._waiting.oldest_enqueued_s()
        assert oldest_s is not None  # only called with requests waiting
        until_s = oldest_s + self.config.window_ms / 1000.0
        return until_s if now < until_s else None

    def _admit(
        self, now: float, budget: int, scheduled: list[ScheduledRequest], out: SchedulerOutput
    ) -> None:
        for request in self._waiting.ordered(now):
            if len(self._running) >= self.plan.max_num_seqs or budget <= 0:
                break
            num_cached = self.kv.get_computed_blocks(request)
            num_new = self._chunk(request.num_tokens - num_cached, budget)
            if num_new <= 0:
                break
            tables = self.kv.allocate_slots(request, num_new, num_cached)
            if tables is None:
                if not self._running:
                    # The whole pool is free or evictable and the chunk still does not fit.
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                    out.finished.append(request)
                    continue
                break
            self._waiting.remove(request.request_id)
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            if request.first_scheduled_time_s is None:
                # The hit of the first admission is the one reported (usage.cached_tokens).
                request.first_scheduled_time_s = now
                request.num_cached_tokens = num_cached
            scheduled.append(self._schedule(request, num_cached, num_new, tables))
            budget -= num_new

    def _schedule(
        self,
        request: Request,
        start: int,
        num_new: int,
        tables: list[list[int]],
        draft: list[int] | None = None,
    ) -> ScheduledRequest:
        draft = draft or []
        request.num_computed_tokens = start + num_new + len(draft)
        wants_prompt = request.sampling_params.prompt_logprobs is not None
        return ScheduledRequest(
            request=request,
            start=start,
            num_tokens=num_new + len(draft),
            block_tables=tables,
            sample=start + num_new == request.num_tokens,
            want_prompt_logprobs=wants_prompt and start < request.num_prompt_tokens,
            draft_token_ids=draft,
        )

    def _expire_deadlines(self, now: float, out: SchedulerOutput) -> None:
        """Finish (FINISHED_DEADLINE) requests past deadline_s, or not started by queue_deadline_s."""
        for request in self._waiting.requests() + self._running:
            late_start = (
                request.queue_deadline_s is not None
                and request.first_scheduled_time_s is None
                and now > request.queue_deadline_s
            )
            late_end = request.deadline_s is not None and now > request.deadline_s
            if late_start or late_end:
                self._finish(request, RequestStatus.FINISHED_DEADLINE)
                out.finished.append(request)


def _is_decode(scheduled: ScheduledRequest) -> bool:
    """One token at the end of the outputs: all earlier KV exists."""
    request = scheduled.request
    return (
        scheduled.num_tokens == 1 + len(scheduled.draft_token_ids)
        and scheduled.start >= request.num_prompt_tokens
        and scheduled.sample
    )


def _shape(output: SchedulerOutput) -> StepShape:
    """The step's features for the cost model."""
    prefill_tokens = decodes = keys = 0
    for s in output.scheduled:
        keys += chunk_attended_keys(s.start, s.num_tokens)
        if _is_decode(s):
            # A draft is one more row of the model, LM head and sampler, as a decode is (a
            # prompt token skips the last two, much of a decode row's cost here).
            decodes += 1 + len(s.draft_token_ids)
        else:
            prefill_tokens += s.num_tokens
    return StepShape(prefill_tokens, decodes, keys)
