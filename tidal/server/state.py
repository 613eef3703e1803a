"""ServerState: what every route reads: the engine client, the effective config, metrics and readiness."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidal.client.engine_client import EngineClient
from tidal.config.engine import TidalConfig
from tidal.loader.generation_config import model_sampling_defaults
from tidal.server.inputs import PromptLimits
from tidal.server.metrics import ServerMetrics
from tidal.server.reasoning import ReasoningParser, resolve_reasoning_parser


@dataclass(slots=True)
class ServerState:
    engine: EngineClient  # in-thread or supervised: the server never asks which
    config: TidalConfig
    metrics: ServerMetrics
    served_name: str  # the model id clients must send (or omit)
    model_root: str  # where the checkpoint was loaded from, shown in /v1/models
    limits: PromptLimits
    reasoning: ReasoningParser | None = None  # server.reasoning_parser, resolved for this model
    # The model's recommended sampling for fields a request leaves unset (model.generation_config)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    warm: bool = False  # warm-up done: /ready may answer 200
    warmup_failures: int = 0  # failed warm-up attempts so far (each retried with backoff)
    warmup_error: str | None = None  # the last failure, shown in /health while retrying
    draining: bool = False  # shutting down: /ready answers 503, new requests get 503

    @property
    def tokenizer(self):  # tidal.loader.tokenizer.Tokenizer
        return self.engine.tokenizer


def model_settings(config: TidalConfig, tokenizer: Any, model_root: str) -> dict[str, Any]:
    """ServerState's fields that depend on the loaded model (`tidal serve` and the Ray ingress
    alike): the reasoning parser and the sampling defaults. ValueError: a setting this model
    cannot take, or a generation config tidal cannot sample with."""
    return {
        "reasoning": resolve_reasoning_parser(config.server.reasoning_parser, tokenizer),
        "sampling_defaults": model_sampling_defaults(config.engine.model, model_root),
    }
