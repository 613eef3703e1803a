"""OutputState: one request's generated text, tokens, logprobs and finish, as vLLM-shaped outputs or per-step deltas."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidal.engine.detokenizer import DecodesTokens, IncrementalDetokenizer
from tidal.engine.stop import Stop, StopChecker
from tidal.request import Request, RequestStatus


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank under the model's distribution
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestMetrics:
    """Times are on the clock that stamped `Request.arrival_time_s` (the engine's clock)."""

    arrival_time_s: float
    first_scheduled_time_s: float | None
    first_token_time_s: float | None
    last_token_time_s: float | None
    finished_time_s: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_preemptions: int


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestDelta:
    """One step's change to one streamed request: what crosses from the engine to its client.

    Only what is new crosses each step: the choices' new text, new token ids and their logprobs,
    and the finish. The prompt never crosses back (the caller sent it); its logprobs cross once,
    complete, on the first delta after the whole prompt was computed (or on the finished one).
    `metrics` (first choice) rides along until its first token has been sent, and on the finished
    delta; `last_token_time_s` (first choice) on every delta, for inter-token latency.
    """

    request_id: str
    outputs: list[CompletionOutput]  # every choice; text, token_ids, logprobs: new this step
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # once, when complete
    metrics: RequestMetrics | None = None
    last_token_time_s: float | None = None


@dataclass(slots=True)
class StepDelta:
    """What one `append` changed: text now safe to stream, tokens kept, and the finish if any."""

    new_text: str
    new_token_ids: list[int]
    finish: RequestStatus | None = None
    stop_reason: int | str | None = None


def make_logprobs(
    token_id: int,
    logprob: float,
    rank: int,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    tokenizer: DecodesTokens | None = None,
) -> dict[int, Logprob]:
    """One position's entry: the chosen token plus the top alternatives (vLLM's shape).

    `top_ids`/`top_logprobs` are already cut to the number the request asked for (best first).
    """

    def text(tid: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([tid], skip_special_tokens=False)

    entry = {
        tid: Logprob(lp, i + 1, text(tid))
        for i, (tid, lp) in enumerate(zip(top_ids, top_logprobs, strict=True))
    }
    entry[token_id] = Logprob(logprob, rank, text(token_id))
    return entry


class OutputState:
    """Per-(sub)request output bookkeeping, fed each step's new tokens by the engine.

    It does not mutate the Request: the engine extends `request.output_token_ids` with
    `StepDelta.new_token_ids` (tokens after a stop are dropped) and sets `request.status` from
    `StepDelta.finish`.
    """

    def __init__(
        self,
        request: Request,
        tokenizer: DecodesTokens,
        prompt: str | None,
        index: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        params = request.sampling_params
        self.request = request
        self.prompt = prompt
        self.index = index
        self.clock = clock
        self.tokenizer = tokenizer
        self.stops = StopChecker(request)
        self.detok = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, params.skip_special_tokens
        )
        self.text = ""  # all output text so far, cut at a stop string once one matched
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None  # no logprob for the first token
        )
        self.finish_reason: RequestStatus | None = None
        self.stop_reason: int | str | None = None
        self.last_token_time_s: float | None = None
        self.finished_time_s: float | None = None
        self._stepped_chars = 0  # text returned by append/finish so far
        self._sent_chars = 0  # text / tokens / logprobs returned by delta calls so far
        self._sent_tokens = 0
        self._sent_prompt_logprobs = False  # take_prompt_logprobs returned them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stable_text(self) -> str:
        """The text that can be shown now: all of it once finished, else minus a possible stop prefix."""
        if self.finished:
            return self.text
        return self.text[: len(self.text) - self.stops.held_back(self.text)]

    def add_prompt_logprobs(self, entries: list[dict[int, Logprob]]) -> None:
        """Appends prompt positions' logprobs (one chunk of a chunked prefill at a time)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(entries)

    def append(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None = None
    ) -> StepDelta:
        """Feeds one step's sampled tokens (several with speculative decoding) and their logprobs."""
        kept: list[int] = []
        for i, token_id in enumerate(token_ids):
            if self.finished:
                break
            if not self.stops.has_room(len(self.token_ids)):
                self._finish(Stop(RequestStatus.FINISHED_LENGTH))  # e.g. max_tokens=0: keep nothing
                break
            kept.append(token_id)
            self._keep(token_id, None if logprobs is None else logprobs[i])
            n = len(self.token_ids)
            stop = self.stops.token_stop(token_id, n)
            if stop is None or self.stops.include_stop_str:
                # A stop token's own text is not output (like vLLM) unless asked for.
                if self._add_text(self.detok.append(token_id)):
                    break
            if stop is None:
                stop = self.stops.length_limit(n)
            if stop is not None:
                self._finish(stop)
        if kept:
            self.last_token_time_s = self.clock()
        return self._step_delta(kept)

    def finish(self, status: RequestStatus) -> StepDelta:
        """Ends the request from outside (abort, deadline, error); held-back text is released."""
        if not self.finished:
            self._finish(Stop(status))
        return self._step_delta([])

    def to_output(self, delta: bool = False) -> RequestOutput:
        """The full output so far, or (delta=True) only what earlier delta calls did not return.

        Unfinished text excludes a tail that might begin a stop string or an incomplete character.
        """
        req = self.request
        return RequestOutput(
            request_id=req.request_id,
            prompt=self.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[self.take_completion() if delta else self._completion(False)],
            finished=self.finished,
            metrics=self.metrics(),
            num_cached_tokens=req.num_cached_tokens,
        )

    def take_completion(self) -> CompletionOutput:
        """This choice's text, tokens and logprobs that no earlier delta call returned."""
        return self._completion(True)

    def take_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprobs, once: when every prompt position has one (or the request
        finished first); None before that, after that, and when none were asked for."""
        if self.prompt_logprobs is None or self._sent_prompt_logprobs:
            return None
        if len(self.prompt_logprobs) < self.request.num_prompt_tokens and not self.finished:
            return None  # a chunked prefill is still filling them in
        self._sent_prompt_logprobs = True
        return list(self.prompt_logprobs)

    def _completion(self, delta: bool) -> CompletionOutput:
        text = self.stable_text
        tokens, logprobs = self.token_ids, self.logprobs
        if delta:
            text = text[self._sent_chars :]
            tokens = tokens[self._sent_tokens :]
            logprobs = None if logprobs is None else logprobs[self._sent_tokens :]
            self._sent_chars += len(text)
            self._sent_tokens += len(tokens)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=None if self.finish_reason is None else self.finish_reason.finish_reason,
            stop_reason=self.stop_reason,
        )

    def metrics(self) -> RequestMetrics:
        req = self.request
        return RequestMetrics(
            arrival_time_s=req.arrival_time_s,
            first_scheduled_time_s=req.first_scheduled_time_s,
            first_token_time_s=req.first_token_time_s,
            last_token_time_s=self.last_token_time_s,
            finished_time_s=self.finished_time_s,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=len(self.token_ids),
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
        )

    def _keep(self, token_id: int, entry: dict[int, Logprob] | None) -> None:
        self.token_ids.append(token_id)
        if self.logprobs is not None and entry is not None:
            self.logprobs.append(entry)
            if self.cumulative_logprob is not None and token_id in entry:
                self.cumulative_logprob += entry[token_id].logprob

    def _add_text(self, new_text: str) -> bool:
        """Appends decoded text; True if it completed a stop string (the request is then finished)."""
        self.text += new_text
        match = self.stops.string_stop(self.text, len(new_text), len(self.token_ids))
        if match is None:
            return False
        self.text = self.stops.truncate(self.text, match)
        self._finish(Stop(RequestStatus.FINISHED_STOPPED, match.stop), flush=False)
        return True

    def _finish(self, stop: Stop, flush: bool = True) -> None:
        if flush and self._add_text(self.detok.flush()):
            return  # the released tail completed a stop string: that stop wins
        self.finish_reason, self.stop_reason = stop
        self.finished_time_s = self.clock()

    def _step_delta(self, kept: list[int]) -> StepDelta:
        text = self.stable_text
        new_text = text[self._stepped_chars :]
        self._stepped_chars = len(text)
        return StepDelta(new_text, kept, self.finish_reason, self.stop_reason)
