"""Config loading: merge dataclass defaults < YAML file < TIDAL_* environment < CLI flags into a TidalConfig.

Every layer only produces `section.key -> value` pairs (see `tidal.config.keys`); the frozen
dataclasses stay the one source of defaults and range checks. Two keys are not plain fields:

- `batching.enabled` is not a field: `false` forces `batching.max_num_seqs` to 1, whatever layer
  set max_num_seqs (the dump then shows `enabled: false, max_num_seqs: 1`).
- `server.max_queue` is set under `server` (an operator thinks of it as a server limit) but lives
  in `SchedulerConfig.max_queue` (the scheduler rejects the overflow); there is no `batching.max_queue`.

Lists (server.api_keys) are replaced by a later layer, never merged.

A YAML file may also use the seed's `fastgpt_config.yaml` layout: its sections under an
`optimization:` wrapper and its names `batching.dynamic_window` (-> batching.window_ms) and
`memory.attention_cache` (-> memory.enable_prefix_caching); its `memory.checkpoint_interval`, a
training setting, is refused with the reason (`tidal.config.key_docs.SEED_KEYS`).
"""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Mapping

import yaml

from tidal.config.cache import KV_CACHE_DTYPES, CacheConfig
from tidal.config.engine import EngineConfig, TidalConfig
from tidal.config.hardware import HardwareConfig
from tidal.config.key_docs import KEY_DOCS, SEED_KEYS
from tidal.config.keys import (
    KEYS,
    SECTION_NAMES,
    SECTIONS,
    ConfigKey,
    coerce_value,
    lookup_key,
    parse_text,
    parse_window_ms,
)
from tidal.config.limits import TRUNCATION_MODES, LimitsConfig
from tidal.config.model import DTYPES, QUANTIZATIONS, ModelConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.config.server import REASONING_PARSERS, ServerConfig

# The seed's fastgpt_config.yaml nests its sections under this key (see key_docs.SEED_KEYS).
SEED_WRAPPER = "optimization"
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
    origin = f"from {path}"
    out: dict[str, object] = {}
    given: dict[str, str] = {}  # tidal key -> the name the file set it with
    for section, name, value in _entries(raw, origin):
        full = f"{section}.{name}"
        seed = SEED_KEYS.get(full)
        if seed is not None and seed.target is not None:
            key = KEYS[seed.target]
            if full == "batching.dynamic_window":
                value = parse_window_ms(value, origin)
        else:
            key = lookup_key(full, origin)  # raises for unknown and refused keys
        if key.full in given:
            names = {full, given[key.full]} - {key.full}
            what = (
                f"{names.pop()} is the seed layout's name for {key.full}, and the file sets both"
                if names
                else f"{key.full} is set twice (at the top level and under {SEED_WRAPPER}:)"
            )
            raise ValueError(f"{what} ({origin}): keep one")
        given[key.full] = full
        out[key.full] = coerce_value(key, value, origin)
    return out


def _entries(raw: dict, origin: str) -> list[tuple[str, str, object]]:
    """(section, name, value) of every key in the file; the seed layout's `optimization:`
    wrapper holds sections too, and its entries count as if written at the top level."""
    sections: list[tuple[str, object]] = []
    for section, body in raw.items():
        if section == SEED_WRAPPER and isinstance(body, dict):
            sections.extend(body.items())
        elif section == SEED_WRAPPER and body is not None:
            raise ValueError(
                f"config section {section!r} ({origin}) must be a mapping of sections, got {body!r}"
            )
        else:
            sections.append((section, body))
    out: list[tuple[str, str, object]] = []
    for section, body in sections:
        if body is None:
            continue
        if section not in SECTION_NAMES:
            lookup_key(f"{section}.", origin)  # raises, naming the known sections
        if not isinstance(body, dict):
            raise ValueError(
                f"config section {section!r} ({origin}) must be a mapping, got {body!r}"
            )
        out.extend((section, name, value) for name, value in body.items())
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
    path: str | None,
    env: Mapping[str, str],
    cli_overrides: Mapping[str, object],
    cli_flags: Mapping[str, str] | None = None,
) -> TidalConfig:
    """Defaults < YAML at `path` < `env` (TIDAL_<SECTION>_<KEY>) < `cli_overrides` (`section.key` -> value).

    Raises ValueError naming the full key, the bad value, what is accepted and where it came from
    (for a CLI value: `cli_flags`' flag for its key, else the key's own flag).
    """
    values: dict[str, object] = {}
    origins: dict[str, str] = {}
    if path:
        for full, value in _file_values(path).items():
            values[full], origins[full] = value, f"from {path}"
    for full, value in _env_values(env).items():
        values[full], origins[full] = value, f"from environment {KEYS[full].env_var}"
    for full, value in cli_overrides.items():
        origin = f"from flag {(cli_flags or {}).get(full) or FLAG_OF.get(full, full)}"
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

# flag -> (key, help), from the one key table. Booleans get --x/--no-x; every default is None so
# "not given" is visible.
_FLAGS: tuple[tuple[str, str, str], ...] = tuple(
    (doc.flag, full, doc.text) for full, doc in KEY_DOCS.items() if doc.flag is not None
)
FLAG_OF: dict[str, str] = {key: flag for flag, key, _ in _FLAGS}
_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPES,
    "model.quantization": QUANTIZATIONS,
    "memory.kv_cache_dtype": KV_CACHE_DTYPES,
    "hardware.dtype": DTYPES,
    "limits.truncation": TRUNCATION_MODES,
    "server.reasoning_parser": REASONING_PARSERS,
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
        # the dest is the flag's: cli_overrides_from_args finds an alias's value there
        names = (flag, *KEY_DOCS[full].aliases)
        if key.base is bool:
            parser.add_argument(
                *names, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        elif key.base is tuple:
            metavar = "KEY" if full == "server.api_keys" else "ORIGIN"
            parser.add_argument(
                *names, default=None, action="append", metavar=metavar, help=help_text
            )
        else:
            parser.add_argument(
                *names, default=None, type=_arg_type(key), choices=_CHOICES.get(full),
                help=help_text,
            )  # fmt: skip
    parser.add_argument(
        "--speculative-config",
        default=None,
        type=_speculative_arg,
        metavar="JSON",
        help='vLLM\'s form of the drafting keys: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 16} (prompt '
        "lookup is the one method)",
    )


def _speculative_arg(text: str) -> dict[str, int]:
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cli_overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    """`section.key -> value` for the flags actually given (an explicit `none` becomes None);
    ValueError when --speculative-config and a flag of its own set one key differently."""
    out: dict[str, object] = {}
    for flag, full, _ in _FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            out[full] = None if value is _NULL else value
    for full, value in (getattr(args, "speculative_config", None) or {}).items():
        if out.get(full, value) != value:
            raise ValueError(
                f"--speculative-config sets {full} to {value!r} and {FLAG_OF[full]} to "
                f"{out[full]!r}: give one"
            )
        out[full] = value
    return out


def cli_flags_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The flag that set each key where it is not the key's own: --speculative-config's keys
    (for load_config's errors)."""
    return {
        full: "--speculative-config" for full in getattr(args, "speculative_config", None) or {}
    }


# vLLM's --speculative-config fields tidal serves, and the keys they set.
_SPECULATIVE_FIELDS = {
    "num_speculative_tokens": "batching.num_speculative_tokens",
    "prompt_lookup_max": "batching.prompt_lookup_max",
    "prompt_lookup_min": "batching.prompt_lookup_min",
    # vLLM: no drafts for new requests while more than this many are enqueued; tidal: no drafts
    # in a step with more decoding sequences.
    "disable_by_batch_size": "batching.speculative_max_num_seqs",
}


def parse_speculative_config(text: str) -> dict[str, int]:
    """vLLM's `--speculative-config` JSON as tidal's keys (its errors read after the flag's
    name). Only its "ngram" method (prompt lookup) exists here; a draft model, EAGLE, Medusa or
    MTP is refused, not ignored. As in vLLM, one lookup bound given alone sets the other too."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("expected a JSON object")
    method = spec.get("method")
    if method != "ngram":
        what = f"method {method!r}" if method is not None else "a draft model"
        raise ValueError(
            f"{what} is not served: tidal drafts by prompt lookup only "
            '({"method": "ngram", "num_speculative_tokens": N, "prompt_lookup_max": N, '
            '"prompt_lookup_min": N, "disable_by_batch_size": N})'
        )
    unknown = sorted(set(spec) - {"method", *_SPECULATIVE_FIELDS})
    if unknown:
        raise ValueError(
            f"fields {unknown} are not served (ngram takes {', '.join(_SPECULATIVE_FIELDS)})"
        )
    values: dict[str, int] = {}
    for name in _SPECULATIVE_FIELDS:
        value = spec.get(name)
        if value is not None and type(value) is not int:  # ranges: SchedulerConfig's checks
            raise ValueError(f"{name}={value!r} is not an integer")
        if value is not None:
            values[name] = value
    if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
        values["prompt_lookup_min"] = values["prompt_lookup_max"]
    if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
        values["prompt_lookup_max"] = values["prompt_lookup_min"]
    return {_SPECULATIVE_FIELDS[name]: value for name, value in values.items()}
