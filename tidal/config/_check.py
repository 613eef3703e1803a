"""The one validation helper every config dataclass uses."""

from __future__ import annotations


def check(ok: bool, name: str, value: object, accepted: str) -> None:
    """Raise ValueError naming the field, the bad value and what would be accepted."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {accepted}")
