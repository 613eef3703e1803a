"""EngineConfig and TidalConfig: the chain of section configs, with the checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.config._check import check
from tidal.config.cache import CacheConfig
from tidal.config.hardware import HardwareConfig
from tidal.config.limits import LimitsConfig
from tidal.config.model import ModelConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.config.server import ServerConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine process needs; the HTTP server's settings stay out of it.

    Cross-section errors name the YAML keys (`limits.max_input_tokens`), since no single
    section can see the conflict.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    def __post_init__(self) -> None:
        max_len = self.model.max_model_len
        max_input = self.limits.max_input_tokens
        check(
            max_len is None or max_input is None or max_input <= max_len,
            "limits.max_input_tokens",
            max_input,
            f"at most model.max_model_len ({max_len})",
        )
        # Every running sequence needs at least one token of the step budget to decode.
        check(
            self.scheduler.max_num_batched_tokens >= self.scheduler.max_num_seqs,
            "batching.max_num_batched_tokens",
            self.scheduler.max_num_batched_tokens,
            f"at least batching.max_num_seqs ({self.scheduler.max_num_seqs})",
        )
        # NOTE: when max_model_len is None (taken from the checkpoint) the engine repeats this
        # check after loading; without chunking a full-length prompt must fit one step.
        check(
            self.scheduler.enable_chunked_prefill
            or max_len is None
            or self.scheduler.max_num_batched_tokens >= max_len,
            "batching.max_num_batched_tokens",
            self.scheduler.max_num_batched_tokens,
            f"at least model.max_model_len ({max_len}) when batching.enable_chunked_prefill is false",
        )

    @property
    def weight_dtype(self) -> str:
        """model.dtype, or the compute dtype when it is "auto" (may still be "auto" for the engine)."""
        return self.model.dtype if self.model.dtype != "auto" else self.hardware.dtype


@dataclass(frozen=True, slots=True)
class TidalConfig:
    """The whole effective configuration of `tidal serve`: the engine's part and the server's."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        # Replicas are engine processes: an engine on a thread of the API process is one engine.
        check(
            self.engine.hardware.data_parallel == 1 or self.server.engine_process,
            "hardware.data_parallel",
            self.engine.hardware.data_parallel,
            "1 when server.engine_process is false (each replica is its own engine process)",
        )
