"""report_ignored: the request fields a client sends that tidal does not read, logged once each.

vLLM warns of such fields on every request; tidal names each the first time it comes, so an
operator learns that a client's option (prediction, top_a, a misspelt name) changes nothing,
without a line per request.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# Field names already reported, and how many at most: random names from one client must not
# grow this set or the log without bound.
_REPORTED: set[tuple[str, str]] = set()
MAX_REPORTED = 256


def report_ignored(kind: str, extra: list[str]) -> None:
    """Log once per (request kind, field) the fields a request sent that tidal does not read:
    an operator sees why a client's option changes nothing (vLLM warns of them per request)."""
    if len(_REPORTED) >= MAX_REPORTED:
        return
    new = [name for name in extra if (kind, name) not in _REPORTED][: MAX_REPORTED - len(_REPORTED)]
    if not new:
        return
    _REPORTED.update((kind, name) for name in new)
    shown = ", ".join(repr(name[:64]) for name in new)
    tail = "; no further ones are reported" if len(_REPORTED) >= MAX_REPORTED else ""
    log.warning("%s fields tidal does not read, ignored: %s (each name is reported once%s)",
                kind, shown, tail)  # fmt: skip
