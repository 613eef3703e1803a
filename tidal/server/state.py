"""ServerState: what every route reads: the engine client, the effective config, metrics and readiness."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.client.engine_client import EngineClient
from tidal.config.engine import TidalConfig
from tidal.server.inputs import PromptLimits
from tidal.server.metrics import ServerMetrics
from tidal.server.reasoning import ReasoningParser


@dataclass(slots=True)
class ServerState:
    engine: EngineClient  # in-thread or supervised: the server never asks which
    config: TidalConfig
    metrics: ServerMetrics
    served_name: str  # the model id clients must send (or omit)
    model_root: str  # where the checkpoint was loaded from, shown in /v1/models
    limits: PromptLimits
    reasoning: ReasoningParser | None = None  # server.reasoning_parser, resolved for this model
    warm: bool = False  # warm-up done: /ready may answer 200
    warmup_failures: int = 0  # failed warm-up attempts so far (each retried with backoff)
    warmup_error: str | None = None  # the last failure, shown in /health while retrying
    draining: bool = False  # shutting down: /ready answers 503, new requests get 503

    @property
    def tokenizer(self):  # tidal.loader.tokenizer.Tokenizer
        return self.engine.tokenizer
