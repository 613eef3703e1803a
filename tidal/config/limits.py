"""LimitsConfig: how long a prompt may be and what happens to one that is longer."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config._check import check

# reject: answer 400. left: drop the oldest tokens, keeping the system prompt (chat) intact.
TRUNCATION_MODES = ("reject", "left")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    # Most prompt tokens accepted; None means the context limit (model.max_model_len).
    max_input_tokens: int | None = None
    truncation: str = "reject"

    def __post_init__(self) -> None:
        check(
            self.max_input_tokens is None or self.max_input_tokens >= 1,
            "max_input_tokens",
            self.max_input_tokens,
            "an integer >= 1 or None",
        )
        check(
            self.truncation in TRUNCATION_MODES,
            "truncation",
            self.truncation,
            " or ".join(TRUNCATION_MODES),
        )
