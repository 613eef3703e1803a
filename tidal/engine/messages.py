"""Engine messages: the small typed objects the API process and the engine process exchange over a pipe.

API process -> engine process: AddRequest, AbortRequest, Shutdown.
Engine process -> API process: EngineReady (once, after loading), StepOutputs (one per step that
changed anything, outputs batched; each RequestDelta carries only what is new), Heartbeat (~every 0.5 s from its own thread), EngineFailed
(the engine could not start). Every message pickles; tests/engine/test_messages.py round-trips each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.engine.output import RequestDelta
from tidal.engine.stats import StepStats
from tidal.sampling_params import SamplingParams


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    session_id: str | None = None
    timeout_s: float | None = None
    queue_timeout_s: float | None = None


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class Shutdown:
    """Stop stepping and exit 0; requests still in the engine are dropped (the client fails them)."""


@dataclass(slots=True)
class EngineReady:
    """The engine is loaded (and warmed up when asked): what the API process needs to serve it."""

    pid: int
    incarnation: int
    max_model_len: int
    vocab_size: int
    num_blocks: int
    load_time_s: float
    device_type: str  # "cpu" or "cuda"
    device_memory_bytes: int | None  # total memory of the CUDA device, None on CPU


@dataclass(slots=True)
class RequestFailure:
    """A request the engine refused or dropped; `kind` picks the exception the caller sees."""

    request_id: str
    kind: str  # "queue_full" | "invalid" (ValueError) | "engine" (EngineError)
    message: str


@dataclass(slots=True)
class StepOutputs:
    """Everything one engine step (or one batch of commands) produced, in one message."""

    outputs: list[RequestDelta] = field(default_factory=list)
    failures: list[RequestFailure] = field(default_factory=list)
    stats: StepStats | None = None  # the step's statistics; None when no step ran
    num_steps: int = 0  # steps run by this engine so far (progress for the watchdog)


@dataclass(slots=True)
class Heartbeat:
    num_steps: int  # unchanged between beats while work is pending means a stuck step loop
    num_unfinished: int


@dataclass(slots=True)
class EngineFailed:
    """The engine process could not start. kind "config" is a ValueError (a bad setting)."""

    kind: str  # "config" | "error"
    message: str


ToEngine = AddRequest | AbortRequest | Shutdown
FromEngine = EngineReady | StepOutputs | Heartbeat | EngineFailed
