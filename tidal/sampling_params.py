"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value: -100 bans a token in practice, 100 forces it.
_MAX_LOGIT_BIAS = 100.0
# Choices per request: OpenAI's own limit. Each choice is a sequence with its own KV blocks, so an
# unbounded n lets one request take the whole server (the server's own cap, server.max_n, is lower).
MAX_N = 128
# What a StructuredOutputs constraint may be: its `spec` is JSON-schema text, a regex, a JSON list
# of strings, a Lark/EBNF grammar, or "" for json_object (any JSON object).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A grammar every generated token must keep the output inside (OpenAI's response_format,
    vLLM's structured_outputs). Plain strings so it pickles small and hashes as a cache key;
    compiling and validating it is tidal/structured's job.

    EOS is allowed only where the grammar accepts; a request that reaches max_tokens first
    finishes with "length". `whitespace_flexible` False makes JSON compact (no free whitespace,
    which a small greedy model can otherwise repeat until max_tokens).
    """

    kind: str
    spec: str = ""
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS, "structured_outputs", self.kind,
               f"a kind in {', '.join(STRUCTURED_KINDS)}")  # fmt: skip
        _check(isinstance(self.spec, str), "structured_outputs", self.spec, "a string spec")
        _check(self.kind == "json_object" or bool(self.spec), "structured_outputs", self.spec,
               f"a non-empty spec for kind {self.kind!r}")  # fmt: skip


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding parameters.

    Defaults follow vLLM/OpenAI: temperature 1.0 samples; 0 means greedy. `top_k` 0 or -1 and
    `top_p` 1.0 disable those filters. Validation raises `ValueError` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling and logprobs (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Constrained decoding: the output must match this grammar (None: unconstrained).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(1 <= self.n <= MAX_N, "n", self.n, f"an integer in [1, {MAX_N}]")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "a number >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a number in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "0 or -1 (disabled) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "a number in [0, 1]")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "a number in [-2, 2]",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "a number in [-2, 2]",
        )
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            self.repetition_penalty,
            "a number in (0, 10]",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 0,
            "max_tokens",
            self.max_tokens,
            "an integer >= 0 or None",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"at most max_tokens ({self.max_tokens})",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= _MAX_LOGPROBS,
            "logprobs",
            self.logprobs,
            f"an integer in [0, {_MAX_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= _MAX_LOGPROBS,
            "prompt_logprobs",
            self.prompt_logprobs,
            f"an integer in [0, {_MAX_LOGPROBS}]",
        )

        for token, bias in (self.logit_bias or {}).items():
            _check(
                isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                "logit_bias",
                token,
                "token ids (integers >= 0) as keys",
            )
            _check(
                isinstance(bias, (int, float))
                and not isinstance(bias, bool)
                and -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS,
                "logit_bias",
                {token: bias},
                f"biases in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]",
            )

        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            self.structured_outputs,
            "a StructuredOutputs or None",
        )
        # A constrained output ends where its grammar accepts (EOS is only allowed there), so a
        # request cannot also ask to run past EOS or to hold it back for a minimum length.
        _check(
            self.structured_outputs is None or not self.ignore_eos,
            "ignore_eos",
            self.ignore_eos,
            "false with a structured output constraint (the output ends where the grammar does)",
        )
        _check(
            self.structured_outputs is None or self.min_tokens == 0,
            "min_tokens",
            self.min_tokens,
            "0 with a structured output constraint (the output ends where the grammar does)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {accepted}")
