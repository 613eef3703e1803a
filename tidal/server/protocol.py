"""OpenAI API request bodies (completions, chat, tokenize) as pydantic models that build SamplingParams.

Parsing is strict about types (JSON `"16"` is not an integer, `1` is not `true`) and lenient about
presence: every optional field also accepts `null` (the `openai` SDK sends `null` for an explicit
None), and unknown fields are accepted and ignored, because OpenAI clients send newer fields
(`store`, `metadata`, `service_tier`, ...) that change nothing here.

Accepted but ignored: `user`. `logit_bias` (token-id keys, values in [-100, 100]) is applied in
the sampler. `response_format` (json_object, json_schema) and vLLM's `structured_outputs` /
`guided_*` constrain the output with a grammar (server/structured.py; one constraint per request).
`tools`, `tool_choice` and `parallel_tool_calls` are served by server/tools.py (a forced choice is
one more output constraint). Rejected with 400 because we cannot honour them: completions
`suffix`, `best_of` other than `n`, chat `modalities` other than text, and the fields of
server/unserved.py when they ask for anything.
Ranges are checked once, by SamplingParams; `to_sampling_params` names the request's own param.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tidal.sampling_params import SamplingParams
from tidal.server.errors import bad_request, from_validation_error
from tidal.server.ignored import report_ignored
from tidal.server.structured import extra_specs, one_spec, response_format_spec
from tidal.server.tools import ToolMode, check_tools, forced_spec, tool_mode
from tidal.server.unserved import CHAT_UNSERVED, UNSERVED, unless_default

_ROLES = ("system", "user", "assistant", "developer", "tool")
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _given(value: Any, default: Any) -> Any:
    """A request field's value, or `default` where it is absent or null."""
    return default if value is None else value


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Request(_Body):
    """A whole request body: fields tidal does not read are kept aside (not ignored unseen),
    so parse_request can say which ones a client sends in vain, as vLLM warns of them."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False  # one final chunk with `usage` and no choices
    continuous_usage_stats: bool | None = False  # vLLM: `usage` on every chunk


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


# No model recommendation (model.generation_config none, or the checkpoint has none).
_NONE: Mapping[str, Any] = MappingProxyType({})
# Stop strings are matched against every step's output in the engine: a bound keeps one request
# from costing every other one time (OpenAI takes 4, TGI 4 by default).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the only served model
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stop_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: all that fit
    # vLLM's: the prompt's and each choice's token ids in the reply (RL rollouts train on them)
    return_token_ids: bool | None = False
    # vLLM's: the prompt's logprobs, this many top alternatives per position (0 to 20)
    prompt_logprobs: int | None = None
    # vLLM's and OpenAI's fields tidal cannot honour: a 400 naming the field when one is set to
    # anything but its default (UNSERVED), rather than a reply that silently ignores it.
    use_beam_search: Any = None
    length_penalty: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    # tidal's own: higher runs first; a deadline that may only shorten server.request_timeout_s;
    # a deadline to start by that may only shorten server.queue_timeout_s; a session id whose
    # turns the prefix cache keeps warm.
    priority: int | None = 0
    timeout_s: float | None = None
    queue_timeout_s: float | None = None
    session_id: str | None = None
    # Constrained output: OpenAI's response_format; vLLM's structured_outputs and guided_*.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_shape(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isdigit() or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"entry {token!r}: {bias!r} must map a token id to a bias in [-100, 100]"
                )
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not _token_ids(v):
            raise ValueError("must be a list of token ids >= 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters"
            )
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError(f"{v!r} must be -1 (as many as fit) or a number of tokens >= 1")
        return v

    @field_validator(*UNSERVED)
    @classmethod
    def _unserved(cls, v: Any, info: ValidationInfo) -> Any:
        return unless_default(UNSERVED, v, info)

    @field_validator("timeout_s", "queue_timeout_s")
    @classmethod
    def _timeout(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"{v!r} must be a positive number of seconds")
        return v

    @field_validator("session_id")
    @classmethod
    def _session(cls, v: str | None) -> str | None:
        if v is not None and not 0 < len(v) <= 256:
            raise ValueError("must be 1 to 256 characters")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _common_kwargs(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        # `defaults`: the model's recommended sampling (model.generation_config), for what the
        # request leaves unset (absent or null), as vLLM applies generation_config.json.
        def model_or(name: str, default: Any) -> Any:
            return _given(getattr(self, name), defaults.get(name, default))

        return {
            "n": _given(self.n, 1),
            "temperature": model_or("temperature", 1.0),
            "top_p": model_or("top_p", 1.0),
            "top_k": model_or("top_k", 0),
            "min_p": model_or("min_p", 0.0),
            "presence_penalty": _given(self.presence_penalty, 0.0),
            "frequency_penalty": _given(self.frequency_penalty, 0.0),
            "repetition_penalty": model_or("repetition_penalty", 1.0),
            "seed": self.seed,
            "min_tokens": _given(self.min_tokens, 0),
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": bool(self.ignore_eos),
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "skip_special_tokens": _given(self.skip_special_tokens, True),
            "logit_bias": (
                {int(t): float(b) for t, b in self.logit_bias.items()} if self.logit_bias else None
            ),
            "structured_outputs": one_spec(self._output_constraints()),
        }

    def _output_constraints(self) -> list:
        return response_format_spec(self.response_format) + extra_specs(
            self.structured_outputs,
            self.guided_json,
            self.guided_regex,
            self.guided_choice,
            self.guided_grammar,
        )

    def _build(self, kwargs: dict[str, Any], params: dict[str, str]) -> SamplingParams:
        """SamplingParams(**kwargs), its ValueError turned into a 400 naming the request's param."""
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            text = str(e)
            field = text.split("=", 1)[0]
            param = params.get(field, field)
            raise bad_request(f"{param}{text[len(field) :]}", param, "invalid_value") from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; an explicit null runs to the context limit
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = True  # vLLM: let the tokenizer add BOS

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: object) -> object:
        ok = isinstance(v, str) or (
            isinstance(v, list)
            and len(v) > 0
            and (
                all(isinstance(p, str) for p in v)
                or _token_ids(v)
                or all(_token_ids(p) and len(p) > 0 for p in v)  # type: ignore[arg-type]
            )
        )
        if not ok:
            raise ValueError(f"must be {_PROMPT_SHAPES} (non-empty lists, token ids >= 0)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != (info.data.get("n") or 1):
            raise ValueError(f"best_of={v} is not supported unless it equals n")
        return v

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: one choice group per entry (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]

    def to_sampling_params(self, defaults: Mapping[str, Any] = _NONE) -> SamplingParams:
        kwargs = self._common_kwargs(defaults)
        # An explicit null runs to the context limit, or to the model's max_new_tokens if it
        # recommends one; left out, OpenAI's 16.
        kwargs["max_tokens"] = _given(self.max_tokens, defaults.get("max_tokens"))
        kwargs["logprobs"] = self.logprobs
        # echo with logprobs returns the prompt's logprobs too, as OpenAI does; vLLM's
        # prompt_logprobs asks for them alone. The engine computes the larger of the two.
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        asked = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        kwargs["prompt_logprobs"] = max(asked) if asked else None
        names = {
            "prompt_logprobs": "prompt_logprobs" if self.prompt_logprobs is not None else "logprobs"
        }
        return self._build(kwargs, names)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # validate_default: a missing content is checked like an explicit null.
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, rendered back
    # An assistant turn's reasoning as a reply gave it (`reasoning` is vLLM's newer name); the
    # template gets it as `reasoning_content` (Qwen3's replays the latest turn's).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v: object) -> object:
        if v not in _ROLES:
            raise ValueError(f"{v!r} is not a role: expected one of {', '.join(_ROLES)}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: object, info: ValidationInfo) -> object:
        if v is None:
            if info.data.get("role") != "assistant":
                raise ValueError("content may be null only in assistant messages")
            return v
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
                    raise ValueError(
                        f"part {i} has type {kind!r}: only {{'type': 'text', 'text': <string>}} parts are supported"
                    )
        elif not isinstance(v, str):
            raise ValueError("must be a string or a list of text parts")
        return v

    @field_validator("reasoning_content", "reasoning")
    @classmethod
    def _reasoning(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry reasoning")
        return v

    def text(self) -> str:
        """The content as one string (text parts joined with nothing between, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _check_messages(v: list[ChatMessage]) -> list[ChatMessage]:
    if not v:
        raise ValueError("must hold at least one message")
    return v


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions for the chat template.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # one of the checkpoint's named templates (inputs.py)
    # Passed to the chat template where it reads it (gpt-oss's do); refused where not (inputs.py)
    reasoning_effort: str | None = None
    # OpenAI's prefix-cache hint: a session_id when the request sends none (routes_chat.py)
    prompt_cache_key: str | None = None
    # Output kinds: text is all a language model here writes.
    modalities: list[str] | None = None
    audio: Any = None  # and the rest: refused when set (CHAT_UNSERVED)
    web_search_options: Any = None
    store: Any = None
    verbosity: Any = None
    service_tier: Any = None
    echo: Any = None
    documents: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        return _check_messages(v)

    @field_validator(*CHAT_UNSERVED)
    @classmethod
    def _chat_unserved(cls, v: Any, info: ValidationInfo) -> Any:
        return unless_default(CHAT_UNSERVED, v, info)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v and any(m != "text" for m in v):
            raise ValueError(f"{v!r} asks for output other than text; only ['text'] is served")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v > 0 and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_tools(v)

    def tool_mode(self) -> ToolMode:
        """none / auto / required / named (server/tools.py); a 400 naming tool_choice if bad."""
        return tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _output_constraints(self) -> list:
        forced = forced_spec(self.tool_mode())
        return super()._output_constraints() + ([("tool_choice", forced)] if forced else [])

    def to_sampling_params(self, defaults: Mapping[str, Any] = _NONE) -> SamplingParams:
        kwargs = self._common_kwargs(defaults)
        uses_new = self.max_completion_tokens is not None
        # None runs to the model's max_new_tokens if it recommends one, else to the context
        # limit (Request.max_model_len), like OpenAI and vLLM chat.
        asked = self.max_completion_tokens if uses_new else self.max_tokens
        kwargs["max_tokens"] = _given(asked, defaults.get("max_tokens"))
        kwargs["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        kwargs["prompt_logprobs"] = self.prompt_logprobs  # vLLM's: of the rendered conversation
        names = {
            "max_tokens": "max_completion_tokens" if uses_new else "max_tokens",
            "logprobs": "top_logprobs",
        }
        return self._build(kwargs, names)


_T = TypeVar("_T", bound=BaseModel)


def parse_request(
    cls: type[_T], body: bytes | str | object, read: frozenset[str] = frozenset()
) -> _T:
    """Validate a raw JSON body (bytes/str) or decoded JSON into `cls`; errors become a 400 APIError.
    Fields of the body that tidal does not read (`cls` has no such field and `read` does not
    name it) are logged, each name once (report_ignored)."""
    try:
        if isinstance(body, bytes | str):
            req = cls.model_validate_json(body)
        else:
            req = cls.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    extra = req.model_extra
    if extra and any(name not in read for name in extra):
        report_ignored(cls.__name__, [name for name in extra if name not in read])
    return req


def decode_json(body: bytes | str) -> Any:
    """The decoded body, or a 400 `invalid_json`."""
    try:
        return json.loads(body)
    except ValueError as e:
        raise bad_request(
            f"The request body is not valid JSON: {e}.", None, "invalid_json"
        ) from None
