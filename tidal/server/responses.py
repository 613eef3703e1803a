"""OpenAI API response bodies: completions, chat completions, their stream chunks, usage, logprobs, models, tokenize.

Field names and nesting follow OpenAI exactly, so the `openai` SDK parses them into its own types.
`finish_reason` is a plain string: "stop" and "length" are OpenAI's; the server maps tidal's other
endings (abort, deadline, rejected, error) to an error response or an in-stream error event.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, model_serializer

# JSON has no -inf; a token the model rules out (logprob -inf) is reported as this, as vLLM does.
MIN_LOGPROB = -9999.0


def _finite(v: float) -> float:
    return MIN_LOGPROB if v != v or v < MIN_LOGPROB else v  # v != v: NaN


Logprob = Annotated[float, AfterValidator(_finite)]


def random_id(prefix: str) -> str:
    """`cmpl-<32 hex>` / `chatcmpl-<32 hex>`: OpenAI's id shapes."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now_s() -> int:
    return int(time.time())


class PromptLogprob(BaseModel):
    """One token of a prompt position's vLLM-shaped prompt_logprobs entry."""

    logprob: Logprob
    rank: int | None = None  # 1-based under the model's distribution
    decoded_token: str | None = None


# A prompt's logprobs: per position (None for the first), token id -> its entry (the top
# alternatives asked for and the prompt's own token)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _absent(value: object) -> bool:
    return value is None


# vLLM's extras on a reply (return_token_ids, prompt_logprobs): left out of the JSON while None,
# so replies that did not ask keep OpenAI's shape (pydantic-core drops them; ~3 us a chunk).
def _asked() -> Any:
    return Field(default=None, exclude_if=_absent)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens inside the think block (tags not counted)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # Chat completions with a reasoning parser (server.reasoning_parser) only.
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> UsageInfo:
        details = (
            None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


# --- /v1/completions --------------------------------------------------------------------------


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token of `text`."""

    text_offset: list[int] = Field(default_factory=list)  # character offset of each token in text
    token_logprobs: list[Logprob | None] = Field(
        default_factory=list
    )  # None: first prompt token (echo)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = _asked()  # return_token_ids: its prompt (first chunk)
    token_ids: list[int] | None = _asked()  # return_token_ids: the tokens of this text
    prompt_logprobs: PromptLogprobs | None = _asked()  # its prompt's (first chunk)


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    """One `data:` chunk; the usage-only chunk (include_usage) has `choices: []`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions ---------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None  # UTF-8 bytes of token; lets clients rebuild split characters


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    # The think block (server.reasoning_parser), under DeepSeek's name, which SGLang and most
    # clients read, and under vLLM's newer one; both null when the model has no reasoning parser.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _asked()  # return_token_ids: the reply's tokens


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = _asked()  # return_token_ids: the rendered conversation
    prompt_logprobs: PromptLogprobs | None = _asked()  # of the rendered conversation


class DeltaMessage(BaseModel):
    """A stream delta: the first carries role (and ""), later ones content, the last is {}."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    # New think-block text (server.reasoning_parser), under both names as in ChatResponseMessage.
    reasoning_content: str | None = None
    reasoning: str | None = None
    # [{"index", "id", "type", "function": {"name", "arguments"}}]: a call's first fragment
    # carries id and name, later ones more of function.arguments (OpenAI's stream shape).
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: Any) -> dict[str, Any]:
        # OpenAI omits absent delta fields rather than sending null.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _asked()  # return_token_ids: this delta's tokens


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _asked()  # return_token_ids: on the first chunk
    prompt_logprobs: PromptLogprobs | None = _asked()  # on the first chunk


# --- /v1/models, /tokenize, /detokenize -------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now_s)
    owned_by: str = "tidal"
    root: str | None = None  # the checkpoint path or name it was loaded from
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def prompt_logprobs_json(entries: list | None, prompt_ids: list[int], k: int) -> PromptLogprobs:
    """The engine's prompt logprobs (token id -> Logprob per position) as vLLM's JSON, each
    position cut to the `k` best alternatives plus the prompt's own token (the engine may have
    computed more, for echo with a larger logprobs)."""
    out: PromptLogprobs = []
    for pos, entry in enumerate(entries or []):
        if entry is None:
            out.append(None)
            continue
        own = prompt_ids[pos] if pos < len(prompt_ids) else None
        out.append(
            {
                str(tid): PromptLogprob(
                    logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token
                )
                for tid, lp in entry.items()
                if tid == own or (lp.rank is not None and lp.rank <= k)
            }
        )
    return out
