"""Prompt inputs: text, token ids or chat messages -> token ids within the server's length limits."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.limits import LimitsConfig
from tidal.config.server import ServerConfig
from tidal.loader.chat_template import choose_named_template, cut_after_final_message
from tidal.sampling_params import SamplingParams
from tidal.server.errors import bad_request
from tidal.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from tidal.server.protocol_tokenize import (
    TokenizeChatRequest,
)
from tidal.server.tools import (
    ToolMode,
    plain_tool_turns,
    template_message,
    tool_mode,
    with_tool_text,
)


@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    text: str | None  # the prompt as given, for echo; None when it came as token ids


@dataclass(frozen=True, slots=True)
class PromptLimits:
    max_model_len: int
    vocab_size: int
    max_input_tokens: int  # the smaller of limits.max_input_tokens and max_model_len - 1
    truncate_left: bool

    @staticmethod
    def of(limits: LimitsConfig, max_model_len: int, vocab_size: int) -> PromptLimits:
        # At least one position must stay free for the first generated token.
        cap = max_model_len - 1
        if limits.max_input_tokens is not None:
            cap = min(cap, limits.max_input_tokens)
        return PromptLimits(max_model_len, vocab_size, cap, limits.truncation == "left")


def _too_long(num_tokens: int, limits: PromptLimits, param: str) -> Exception:
    return bad_request(
        f"The prompt has {num_tokens} tokens, more than the {limits.max_input_tokens} this server "
        f"accepts (limits.max_input_tokens / a context of {limits.max_model_len} tokens).",
        param,
        "context_length_exceeded",
    )


def completion_inputs(req: CompletionRequest, tokenizer, limits: PromptLimits) -> list[PromptInput]:
    """One input per prompt of a /v1/completions request; left-truncated or 400 when too long."""
    out: list[PromptInput] = []
    add_special = req.add_special_tokens is not False
    for prompt in req.prompts():
        if isinstance(prompt, str):
            ids, text = tokenizer.encode(prompt, add_special_tokens=add_special), prompt
        else:
            ids, text = list(prompt), None
            bad = next((t for t in ids if t >= limits.vocab_size), None)
            if bad is not None:
                raise bad_request(
                    f"Invalid value for 'prompt': token id {bad} is outside the vocabulary "
                    f"(expected ids in [0, {limits.vocab_size}))",
                    "prompt",
                    "invalid_value",
                )
        if not ids:
            raise bad_request("The prompt is empty: expected at least one token.", "prompt")
        keep = _asked_to_keep(req, limits)
        if limits.truncate_left:
            keep = min(keep, limits.max_input_tokens)
        if len(ids) > keep:
            ids = _keep_last(ids, keep, tokenizer)
            text = None if text is None else tokenizer.decode(ids, skip_special_tokens=True)
        if len(ids) > limits.max_input_tokens:
            raise _too_long(len(ids), limits, "prompt")
        out.append(PromptInput(ids, text))
    return out


def _asked_to_keep(req: CompletionRequest | ChatCompletionRequest, limits: PromptLimits) -> int:
    """vLLM's truncate_prompt_tokens: the most prompt tokens to keep (-1: all that fit)."""
    k = req.truncate_prompt_tokens
    return limits.max_input_tokens if k == -1 else k if k is not None else 1 << 62


def _keep_last(ids: list[int], keep: int, tokenizer) -> list[int]:
    """The last `keep` tokens, BOS kept in front: the model was trained to see it first."""
    if len(ids) <= keep:
        return ids
    bos = getattr(tokenizer, "bos_token_id", None)
    return [ids[0], *ids[len(ids) - keep + 1 :]] if ids[0] == bos and keep > 1 else ids[-keep:]


def _message_dict(m: ChatMessage) -> dict:
    # OpenAI's "developer" role is the newer name of "system".
    out: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        out = template_message(
            {**out, "content": m.content and m.text(), "tool_calls": m.tool_calls}
        )
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def _render(
    req: ChatCompletionRequest | TokenizeChatRequest,
    tokenizer,
    messages: list[dict],
    mode: ToolMode | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    extra = dict(req.chat_template_kwargs or {})
    if req.chat_template is not None:
        extra["chat_template"] = req.chat_template
    if "chat_template" in extra:
        extra["chat_template"] = _named_template(extra["chat_template"], tokenizer)
    cont = bool(req.continue_final_message)
    tools = list(mode.tools) if mode is not None and mode.tools else None
    # The template apply_chat_template will pick, by its own rule: what it reads decides the
    # reasoning effort's check and whether tools and tool turns need a plain-text form.
    template = choose_named_template(
        tokenizer.chat_template, getattr(tokenizer, "named_chat_templates", {}),
        extra.get("chat_template"), tools is not None,
    )  # fmt: skip
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        extra["reasoning_effort"] = _reasoning_effort(effort, template)
    messages = plain_tool_turns(messages, template)
    if tools is not None:
        extra["tools"] = tools
        messages = with_tool_text(messages, mode, template)  # type: ignore[arg-type]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=bool(req.add_generation_prompt) and not cont, **extra
        )
    except Exception as e:  # template errors (wrong roles, raise_exception) are the request's fault
        raise bad_request(
            f"Invalid value for 'messages': {e}", "messages", "invalid_value"
        ) from None
    if cont and messages and messages[-1]["role"] == "assistant":
        text = _cut_after_final_message(text, str(messages[-1].get("content") or ""))
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _reasoning_effort(effort: str, template: str | None) -> str:
    """A request's reasoning_effort, for a template that reads it (vLLM passes it the same
    way); a 400 where the template never looks at it, rather than an effort silently lost."""
    if "reasoning_effort" not in (template or ""):
        raise bad_request(
            "Invalid value for 'reasoning_effort': this model's chat template takes no reasoning "
            "effort (a template's own switches go in chat_template_kwargs, e.g. Qwen3's "
            '{"enable_thinking": false})',
            "reasoning_effort",
            "invalid_value",
        )
    return effort


def _named_template(name: object, tokenizer) -> str:
    """A request's chat_template: the name of one of the checkpoint's templates. Template text
    is refused: a template is a program the server would run for whoever sends it (a loop can
    hold the API process for minutes), as vLLM refuses it unless the server trusts requests."""
    default = ["default"] if tokenizer.chat_template is not None else []
    names = [*default, *sorted(getattr(tokenizer, "named_chat_templates", {}))]
    if name not in names:
        shown = name if isinstance(name, str) and len(name) <= 40 else "template text"
        raise bad_request(
            f"Invalid value for 'chat_template': {shown!r} is not one of this model's chat "
            f"templates ({', '.join(names)}); a request may name one but not send its own",
            "chat_template",
            "invalid_value",
        )
    return str(name)


def _cut_after_final_message(text: str, last: str) -> str:
    """cut_after_final_message, its refusal a 400 naming continue_final_message."""
    try:
        return cut_after_final_message(text, last)
    except ValueError as e:
        raise bad_request(
            f"Invalid value for 'continue_final_message': {e}",
            "continue_final_message",
            "invalid_value",
        ) from None


def chat_tokens(req: TokenizeChatRequest, tokenizer) -> list[int]:
    """/tokenize's messages as the chat endpoint renders them (tools, tool turns, a continued
    final message), so the count is the one a chat request would send."""
    mode = tool_mode(req.tools, None, None) if req.tools else None
    messages = [_message_dict(m) for m in req.messages]
    return _render(req, tokenizer, messages, mode, bool(req.add_special_tokens))


def chat_input(
    req: ChatCompletionRequest, tokenizer, limits: PromptLimits, mode: ToolMode | None = None
) -> PromptInput:
    """The rendered conversation (with the tools of `mode`); with truncation=left the oldest
    turns after the system message go first."""
    messages = [_message_dict(m) for m in req.messages]
    ids = _render(req, tokenizer, messages, mode)
    ids = _keep_last(ids, _asked_to_keep(req, limits), tokenizer)  # as vLLM: the rendered ids
    while len(ids) > limits.max_input_tokens and limits.truncate_left:
        head = 1 if messages[0]["role"] == "system" else 0
        rest = messages[head:]
        if len(rest) <= 1:
            break
        rest = rest[1:]
        while len(rest) > 1 and rest[0]["role"] != "user":
            rest = rest[1:]  # a conversation restarts at a user turn (Gemma requires it)
        messages = messages[:head] + rest
        ids = _render(req, tokenizer, messages, mode)
    if len(ids) > limits.max_input_tokens:
        raise _too_long(len(ids), limits, "messages")
    return PromptInput(ids, None)


def check_max_tokens(
    params: SamplingParams, num_prompt_tokens: int, limits: PromptLimits, param: str
) -> None:
    """400 when prompt + max_tokens cannot fit the context (None runs up to the context limit)."""
    if params.max_tokens is None:
        return
    total = num_prompt_tokens + params.max_tokens
    if total > limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {total} tokens ({num_prompt_tokens} in the prompt, {params.max_tokens} in "
            f"the completion). Reduce {param} or the prompt.",
            param,
            "context_length_exceeded",
        )


def check_request_size(
    params: SamplingParams,
    prompt_lengths: list[int],
    limits: PromptLimits,
    server: ServerConfig,
    param: str,
) -> None:
    """400 when a request asks for more choices than server.max_n, or more output tokens in all
    (prompts x n x max_tokens) than server.max_total_output_tokens: each choice is a sequence with
    its own KV blocks, so either unbounded lets one request take every block."""
    if params.n > server.max_n:
        raise bad_request(
            f"n={params.n} is invalid: expected an integer in [1, {server.max_n}] "
            "(this server's limit, server.max_n).",
            "n",
            "invalid_value",
        )
    cap = server.max_total_output_tokens or limits.max_model_len
    # A null max_tokens runs to the context limit, so it counts as the context left.
    per_prompt = [
        params.max_tokens if params.max_tokens is not None else limits.max_model_len - length
        for length in prompt_lengths
    ]
    total = params.n * sum(per_prompt)
    if total > cap:
        shown = "null" if params.max_tokens is None else str(params.max_tokens)
        prompts = f"{len(prompt_lengths)} prompts x " if len(prompt_lengths) > 1 else ""
        raise bad_request(
            f"The request asks for up to {total} output tokens ({prompts}n={params.n} x "
            f"{param}={shown}), more than the {cap} one request may ask for "
            "(server.max_total_output_tokens, by default the context length). Lower n or "
            f"{param}.",
            param,
            "invalid_value",
        )


def check_logit_bias(params: SamplingParams, limits: PromptLimits) -> None:
    """400 naming logit_bias when a key is not a token id of this model's vocabulary."""
    bad = next((t for t in params.logit_bias or {} if t >= limits.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"Invalid key in 'logit_bias': token id {bad} is outside the vocabulary "
            f"(expected ids in [0, {limits.vocab_size}))",
            "logit_bias",
            "invalid_value",
        )
