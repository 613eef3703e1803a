"""Config loading: merge dataclass defaults < YAML file < TIDAL_* environment < CLI flags into a TidalConfig.

Every layer only produces `section.key -> value` pairs (see `tidal.config.keys`); the frozen
dataclasses stay the one source of defaults and range checks. Two keys are not plain fields:

- `batching.enabled` is not a field: `false` forces `batching.max_num_seqs` to 1, whatever layer
  set max_num_seqs (the dump then shows `enabled: false, max_num_seqs: 1`).
- `server.max_queue` is set under `server` (an operator thinks of it as a server limit) but lives
  in `SchedulerConfig.max_queue` (the scheduler rejects the overflow); there is no `batching.max_queue`.

Lists (server.api_keys) are replaced by a later layer, never merged.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Mapping

import yaml

from tidal.config.cache import KV_CACHE_DTYPES, CacheConfig
from tidal.config.engine import EngineConfig, TidalConfig
from tidal.config.hardware import HardwareConfig
from tidal.config.keys import (
    KEYS,
    SECTION_NAMES,
    SECTIONS,
    ConfigKey,
    coerce_value,
    lookup_key,
    parse_text,
)
from tidal.config.limits import TRUNCATION_MODES, LimitsConfig
from tidal.config.model import DTYPES, QUANTIZATIONS, ModelConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.config.server import ServerConfig

# Written in place of each API key by `dump_config`; it contains spaces, which ServerConfig
# rejects, so a masked dump fed back in fails loudly instead of accepting a public "key".
MASK = "*** masked ***"


def _file_values(path: str) -> dict[str, object]:
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"config file {path}: expected a mapping of sections, got {type(raw).__name__}"
        )
    out: dict[str, object] = {}
    for section, body in raw.items():
        origin = f"from {path}"
        if body is None:
            continue
        if section not in SECTION_NAMES:
            lookup_key(f"{section}.", origin)  # raises, naming the known sections
        if not isinstance(body, dict):
            raise ValueError(
                f"config section {section!r} ({origin}) must be a mapping, got {body!r}"
            )
        for name, value in body.items():
            key = lookup_key(f"{section}.{name}", origin)
            out[key.full] = coerce_value(key, value, origin)
    return out


def _env_values(env: Mapping[str, str]) -> dict[str, object]:
    """Only TIDAL_<SECTION>_* variables are config; other TIDAL_* names belong to other tools."""
    by_var = {k.env_var: k for k in KEYS.values()}
    out: dict[str, object] = {}
    for var, text in env.items():
        section = next((s for s in SECTION_NAMES if var.startswith(f"TIDAL_{s.upper()}_")), None)
        if section is None:
            continue
        origin = f"from environment {var}"
        if var not in by_var:
            lookup_key(f"{section}.{var[len(section) + 7 :].lower()}", origin)
        key = by_var[var]
        out[key.full] = parse_text(key, text, origin)
    return out


def load_config(
    path: str | None, env: Mapping[str, str], cli_overrides: Mapping[str, object]
) -> TidalConfig:
    """Defaults < YAML at `path` < `env` (TIDAL_<SECTION>_<KEY>) < `cli_overrides` (`section.key` -> value).

    Raises ValueError naming the full key, the bad value, what is accepted and where it came from.
    """
    values: dict[str, object] = {}
    origins: dict[str, str] = {}
    if path:
        for full, value in _file_values(path).items():
            values[full], origins[full] = value, f"from {path}"
    for full, value in _env_values(env).items():
        values[full], origins[full] = value, f"from environment {KEYS[full].env_var}"
    for full, value in cli_overrides.items():
        origin = f"from flag {FLAG_OF.get(full, full)}"
        values[full], origins[full] = coerce_value(lookup_key(full, origin), value, origin), origin
    return _build(values, origins)


def _build(values: Mapping[str, object], origins: Mapping[str, str]) -> TidalConfig:
    kwargs: dict[type, dict[str, object]] = {cls: {} for _, cls in SECTIONS}
    for full, value in values.items():
        key = KEYS[full]
        if key.owner is not None:
            kwargs[key.owner][key.name] = value
    if values.get("batching.enabled", True) is False:
        kwargs[SchedulerConfig]["max_num_seqs"] = 1
    built: dict[type, object] = {}
    for _, cls in SECTIONS:
        try:
            built[cls] = cls(**kwargs[cls])
        except ValueError as e:
            # The dataclass names its field ("max_queue=0 ..."); name the YAML key instead.
            msg = str(e)
            name = msg.split("=", 1)[0]
            key = next((k for k in KEYS.values() if k.owner is cls and k.name == name), None)
            if key is None:
                raise
            where = f" ({origins[key.full]})" if key.full in origins else ""
            raise ValueError(f"{key.full}{msg[len(name) :]}{where}") from None
    engine = EngineConfig(
        model=built[ModelConfig],  # type: ignore[arg-type]
        hardware=built[HardwareConfig],  # type: ignore[arg-type]
        cache=built[CacheConfig],  # type: ignore[arg-type]
        scheduler=built[SchedulerConfig],  # type: ignore[arg-type]
        limits=built[LimitsConfig],  # type: ignore[arg-type]
    )
    return TidalConfig(engine=engine, server=built[ServerConfig])  # type: ignore[arg-type]


def config_sections(cfg: TidalConfig, mask_secrets: bool = True) -> dict[str, dict[str, object]]:
    """The effective config in the YAML file's shape (lists for tuples, secrets masked)."""
    owners = {
        ModelConfig: cfg.engine.model,
        SchedulerConfig: cfg.engine.scheduler,
        CacheConfig: cfg.engine.cache,
        HardwareConfig: cfg.engine.hardware,
        LimitsConfig: cfg.engine.limits,
        ServerConfig: cfg.server,
    }
    out: dict[str, dict[str, object]] = {s: {} for s in SECTION_NAMES}
    for key in KEYS.values():
        if key.owner is None:
            value: object = cfg.engine.scheduler.max_num_seqs > 1
        else:
            value = getattr(owners[key.owner], key.name)
        if isinstance(value, tuple):
            value = (
                [MASK] * len(value)
                if (mask_secrets and key.full == "server.api_keys")
                else list(value)
            )
        out[key.section][key.name] = value
    return out


def dump_config(cfg: TidalConfig, mask_secrets: bool = True) -> str:
    """YAML of the effective config (`tidal serve --print-config`); loading it back gives `cfg`
    again, except that masked API keys are rejected rather than trusted."""
    return yaml.safe_dump(
        config_sections(cfg, mask_secrets), sort_keys=False, default_flow_style=False
    )


# --- CLI -------------------------------------------------------------------------------------

# flag -> (key, help). Booleans get --x/--no-x; every default is None so "not given" is visible.
_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--model", "model.path", "GGUF file or safetensors folder (none: the bundled model)"),
    ("--weight-dtype", "model.dtype", "dtype weights are held in (auto: the compute dtype)"),
    ("--max-model-len", "model.max_model_len", "context limit, prompt + output"),
    ("--served-model-name", "model.served_model_name", "model id clients use"),
    ("--quantization", "model.quantization", "weight format (check with tidal quantize-check)"),
    ("--device", "hardware.device", "auto, cpu, cuda or cuda:N"),
    ("--dtype", "hardware.dtype", "compute dtype"),
    ("--threads", "hardware.threads", "torch CPU threads"),
    ("--tensor-parallel", "hardware.tensor_parallel", "devices one model is split across"),
    (
        "--batching",
        "batching.enabled",
        "continuous batching (--no-batching: one sequence at a time)",
    ),
    ("--max-num-seqs", "batching.max_num_seqs", "most sequences in one step"),
    ("--max-num-batched-tokens", "batching.max_num_batched_tokens", "most tokens in one step"),
    ("--min-num-seqs", "batching.min_num_seqs", "lowest seat cap the TPOT controller may set"),
    (
        "--target-tpot-ms",
        "batching.target_tpot_ms",
        "size each step so decodes take about this per token",
    ),
    (
        "--target-ttft-ms",
        "batching.target_ttft_ms",
        "raise the prefill share when queued requests would miss this first-token time",
    ),
    (
        "--cpu-budget-step-ms",
        "batching.cpu_budget_step_ms",
        "no target, on CPU: prefill what fits a step this long (none: max-num-batched-tokens)",
    ),
    ("--window-ms", "batching.window_ms", "wait this long when idle to batch arriving prefills"),
    ("--chunked-prefill", "batching.enable_chunked_prefill", "split long prompts across steps"),
    (
        "--priority-aging-s",
        "batching.priority_aging_s",
        "seconds of waiting worth one priority level",
    ),
    (
        "--kv-cache-bytes",
        "memory.kv_cache_bytes",
        "KV pool size, e.g. 2GiB (none: from --memory-fraction)",
    ),
    ("--memory-fraction", "memory.memory_fraction", "fraction of free memory for the KV pool"),
    ("--max-cpu-kv-bytes", "memory.max_cpu_kv_bytes", "cap on the KV pool on CPU"),
    ("--block-size", "memory.block_size", "tokens per KV block"),
    ("--prefix-caching", "memory.enable_prefix_caching", "reuse KV blocks of shared prefixes"),
    ("--prefix-ttl-s", "memory.prefix_ttl_s", "drop idle cached blocks after this many seconds"),
    ("--kv-cache-dtype", "memory.kv_cache_dtype", "KV cache storage (int8/fp8: ~2x the tokens)"),
    (
        "--quantization-gate",
        "memory.quantization_gate",
        "measure perplexity vs float before serving a quantized mode",
    ),
    ("--force-quantization", "memory.force_quantization", "serve even if the gate fails"),
    (
        "--session-turns",
        "memory.session_turns",
        "turns kept per session id ahead of anonymous blocks",
    ),
    ("--max-input-tokens", "limits.max_input_tokens", "most prompt tokens accepted"),
    ("--truncation", "limits.truncation", "over-long prompts: reject (400) or left-truncate"),
    ("--host", "server.host", "address to listen on"),
    ("--port", "server.port", "port to listen on"),
    (
        "--api-key",
        "server.api_keys",
        "accepted bearer key; repeat for several (replaces file/env keys)",
    ),
    ("--max-queue", "server.max_queue", "waiting requests before 429 (none: unbounded)"),
    ("--request-timeout-s", "server.request_timeout_s", "default deadline of a whole request"),
    ("--max-body-bytes", "server.max_body_bytes", "largest request body accepted"),
    (
        "--drain-timeout-s",
        "server.drain_timeout_s",
        "on shutdown, wait this long for running requests",
    ),
    ("--warmup", "server.warmup", "run one request before reporting ready"),
    (
        "--stream-interval-ms",
        "server.stream_interval_ms",
        "coalesce a stream's tokens, send at most this often",
    ),
    (
        "--sse-keepalive-s",
        "server.sse_keepalive_s",
        "SSE comment this often while a stream is queued",
    ),
)
FLAG_OF: dict[str, str] = {key: flag for flag, key, _ in _FLAGS}
_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPES,
    "model.quantization": QUANTIZATIONS,
    "memory.kv_cache_dtype": KV_CACHE_DTYPES,
    "hardware.dtype": DTYPES,
    "limits.truncation": TRUNCATION_MODES,
}


class _Null:
    """What an explicit `--max-queue none` parses to, so it differs from a flag not given (None)."""


_NULL = _Null()


def _arg_type(key: ConfigKey) -> typing.Callable[[str], object]:
    def parse(text: str) -> object:
        if key.optional and text.strip().lower() in ("none", "null"):
            return _NULL
        try:
            return parse_text(key, text, f"from flag {FLAG_OF[key.full]}")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = key.describe()  # argparse shows this name in "invalid ... value" errors
    return parse


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `--config` and one flag per config key; help shows the dataclass default."""
    parser.add_argument(
        "--config", default=None, metavar="PATH", help="YAML config file (see `--print-config`)"
    )
    for flag, full, text in _FLAGS:
        key = KEYS[full]
        shown = (
            "none"
            if full == "server.api_keys"
            else ("null" if key.default is None else key.default)
        )
        help_text = f"{text} [{full}; default {shown}]"
        if key.base is bool:
            parser.add_argument(
                flag, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        elif key.base is tuple:
            parser.add_argument(flag, default=None, action="append", metavar="KEY", help=help_text)
        else:
            parser.add_argument(
                flag, default=None, type=_arg_type(key), choices=_CHOICES.get(full), help=help_text
            )


def cli_overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    """`section.key -> value` for the flags actually given (an explicit `none` becomes None)."""
    out: dict[str, object] = {}
    for flag, full, _ in _FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            out[full] = None if value is _NULL else value
    return out
