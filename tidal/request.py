"""Request: one sequence's prompt, outputs and progress, shared by the scheduler, KV manager and runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidal.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # an EOS / stop token / stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"  # the client went away or asked to abort
    FINISHED_DEADLINE = "deadline"  # its queue or total deadline passed
    FINISHED_REJECTED = "rejected"  # the waiting queue was full
    FINISHED_ERROR = "error"  # the engine failed while it ran

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason, or None while unfinished."""
        return self.value if self.finished else None


@dataclass(slots=True, eq=False)
class Request:
    """A single sequence. `n > 1` is fanned out by the engine into n requests sharing a prefix.

    Token accounting (all counts of tokens of `all_token_ids`):

        |<-------------- prompt -------------->|<---- output ---->|
        |<- num_cached ->|                      (prefix-cache hit, never recomputed)
        |<------------ num_computed_tokens ------------>|           (KV exists for these)
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    session_id: str | None = None
    queue_deadline_s: float | None = None  # absolute clock time by which it must start
    deadline_s: float | None = None  # absolute clock time by which it must finish
    max_model_len: int | None = None  # context limit: prompt + output never exceed it
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens
