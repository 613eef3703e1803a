"""ConfigKey: the table of settable `section.key`s, derived from the config dataclasses, and value parsing."""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import MISSING, dataclass, fields

from tidal.config.cache import CacheConfig
from tidal.config.hardware import HardwareConfig
from tidal.config.key_docs import SEED_KEYS
from tidal.config.limits import LimitsConfig
from tidal.config.model import ModelConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.config.server import ServerConfig

SECTIONS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("batching", SchedulerConfig),
    ("memory", CacheConfig),
    ("hardware", HardwareConfig),
    ("limits", LimitsConfig),
    ("server", ServerConfig),
)


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One settable `section.name`, the dataclass field it lands in, and its value type."""

    section: str
    name: str
    owner: type | None  # None only for batching.enabled, which is not a field
    base: type  # int, float, bool, str or tuple (a tuple of strings)
    optional: bool
    default: object

    @property
    def full(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_var(self) -> str:
        return f"TIDAL_{self.section}_{self.name}".upper()

    def shown(self, value: object) -> str:
        """How a value appears in an error: secrets (server.api_keys) never do."""
        return "'<masked>'" if self.name == "api_keys" else repr(value)

    def describe(self) -> str:
        kind = {
            int: "an integer",
            float: "a number",
            bool: "true or false",
            str: "a string",
            tuple: "a list of strings",
        }[self.base]
        if self.name.endswith("_bytes") and self.base is int:
            kind = "a byte count (1048576, 512MiB, 4G)"
        return f"{kind} or null" if self.optional else kind


def _key_from_field(section: str, cls: type, name: str) -> ConfigKey:
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    base = typing.get_origin(base) or base  # tuple[str, ...] -> tuple
    f = next(f for f in fields(cls) if f.name == name)
    default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return ConfigKey(section, name, cls, base, optional, default)


def _build_keys() -> dict[str, ConfigKey]:
    keys: dict[str, ConfigKey] = {
        "batching.enabled": ConfigKey("batching", "enabled", None, bool, False, True)
    }
    for section, cls in SECTIONS:
        for f in fields(cls):
            if cls is SchedulerConfig and f.name == "max_queue":
                continue
            keys[f"{section}.{f.name}"] = _key_from_field(section, cls, f.name)
            if cls is ServerConfig and f.name == "api_keys":
                keys["server.max_queue"] = _key_from_field("server", SchedulerConfig, "max_queue")
    return keys


KEYS: dict[str, ConfigKey] = _build_keys()
SECTION_NAMES: tuple[str, ...] = tuple(s for s, _ in SECTIONS)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bytes(text: str) -> int:
    """'4G', '4GiB' and '4096M' are binary; '4GB' is decimal (10**9); a bare number is bytes."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a byte count")
    number, unit, binary, b = m.groups()
    base = 1000 if (b and not binary and unit) else 1024
    return int(float(number) * base ** _POWERS[unit.lower()])


def coerce_value(key: ConfigKey, value: object, origin: str) -> object:
    """Check a YAML or CLI value against the key's type; no guessing from strings except sizes."""
    bad = ValueError(
        f"{key.full}={key.shown(value)} is invalid: expected {key.describe()} ({origin})"
    )
    if value is None:
        if not key.optional:
            raise bad
        return None
    if key.base is bool:
        ok = isinstance(value, bool)
    elif key.base is int:
        if isinstance(value, str) and key.name.endswith("_bytes"):
            try:
                value = parse_bytes(value)
            except ValueError:
                raise bad from None
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif key.base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value  # type: ignore[arg-type]
    elif key.base is tuple:
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value  # type: ignore[arg-type]
    elif key.full == "model.override_generation_config" and isinstance(value, dict):
        return value  # a YAML mapping: ModelConfig writes it as the JSON text the flag takes
    else:
        ok = isinstance(value, str)
    if not ok:
        raise bad
    return value


def parse_text(key: ConfigKey, text: str, origin: str) -> object:
    """Parse an environment string: null/none/empty for optional keys, true/false/1/0/yes/no/on/off, commas for lists."""
    bad = ValueError(
        f"{key.full}={key.shown(text)} is invalid: expected {key.describe()} ({origin})"
    )
    t = text.strip()
    if key.optional and t.lower() in ("", "null", "none"):
        return None
    if key.base is bool:
        flag = {
            "true": True,
            "1": True,
            "yes": True,
            "on": True,
            "false": False,
            "0": False,
            "no": False,
            "off": False,
        }
        if t.lower() not in flag:
            raise bad
        return flag[t.lower()]
    if key.base is tuple:
        return tuple(part.strip() for part in t.split(",") if part.strip())
    if key.base is str:
        return t
    try:
        number: float = (
            (parse_bytes(t) if key.name.endswith("_bytes") else int(t))
            if key.base is int
            else float(t)
        )
    except ValueError:
        raise bad from None
    return coerce_value(key, number, origin)


# `dynamic_window: true` in the seed layout turns the admission window on at this length: long
# enough to gather requests that arrive together, short beside a CPU step (100 ms and more).
DYNAMIC_WINDOW_ON_MS = 20.0
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s)?", re.IGNORECASE)


def parse_window_ms(value: object, origin: str) -> float:
    """The seed's `dynamic_window` as batching.window_ms: milliseconds, '20ms' / '0.02s', or a bool."""
    if isinstance(value, bool):
        return DYNAMIC_WINDOW_ON_MS if value else 0.0
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        return float(value)
    m = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise ValueError(
            f"batching.dynamic_window={value!r} is invalid: expected milliseconds (20), a "
            f"duration ('20ms', '0.02s'), true ({DYNAMIC_WINDOW_ON_MS:g} ms) or false ({origin})"
        )
    number, unit = float(m.group(1)), (m.group(2) or "ms").lower()
    return number * 1000.0 if unit == "s" else number


def lookup_key(full: str, origin: str) -> ConfigKey:
    if full not in KEYS:
        seed = SEED_KEYS.get(full)
        if seed is not None and seed.target is None:
            raise ValueError(f"{full} is not supported ({origin}): it is {seed.text}")
        section = full.split(".", 1)[0]
        if section not in SECTION_NAMES:
            raise ValueError(
                f"unknown config section {section!r} ({origin}): expected one of {', '.join(SECTION_NAMES)}"
            )
        known = ", ".join(k.name for k in KEYS.values() if k.section == section)
        raise ValueError(f"unknown config key {full!r} ({origin}): {section} accepts {known}")
    return KEYS[full]
