"""Reasoning parsers: a chat answer's <think>...</think> block split out as reasoning_content.

A reasoning model writes its chain of thought between a start and an end tag, then the answer.
Chat completions return the two apart, as DeepSeek's API does: `message.reasoning_content` (and
`delta.reasoning_content` in a stream) holds the thought, `content` only the answer. The
Completions API never parses: it returns the raw text.

Where the output starts is read from the prompt, not guessed from the output. The text the chat
template puts after the last message (the generation prompt, or the continued assistant message)
decides: a start tag left open there (R1's template ends with "<think>\\n") means the output is
reasoning from its first token and the start tag never appears in it; a closed block (Qwen3 with
enable_thinking false writes "<think>\\n\\n</think>\\n\\n") means it is all answer; no tag at all
leaves it to the parser: deepseek_r1 reasons first (R1 always thinks, and older R1 templates let
the model write "<think>" itself), qwen3 answers unless the output opens with "<think>".

Each part starts at its first non-whitespace character (R1 writes "</think>\\n\\n" before the
answer). A part that never started is None: with no end tag the answer is None, not "".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tidal.config.server import REASONING_PARSERS
from tidal.server.inputs import _message_dict
from tidal.server.protocol import ChatCompletionRequest
from tidal.server.responses import ChatResponseMessage, CompletionTokensDetails, DeltaMessage

log = logging.getLogger(__name__)

START_TAG = "<think>"
END_TAG = "</think>"

# The parsers REASONING_PARSERS names besides auto and none: whether the output reasons first when
# the prompt leaves it to the model.
REASONS_BY_DEFAULT: dict[str, bool] = {"deepseek_r1": True, "qwen3": False}


@dataclass(frozen=True, slots=True)
class Split:
    """One piece of output, split: the reasoning part and the answer part (either may be "")."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A think-tag parser bound to one tokenizer's ids for its tags."""

    name: str
    reasons_by_default: bool  # the output's first state when the prompt leaves it to the model
    start_ids: tuple[int, ...]  # the tags as this tokenizer encodes them (one id each for R1/Qwen3)
    end_ids: tuple[int, ...]
    start_tag: str = START_TAG
    end_tag: str = END_TAG

    def starts_in_reasoning(self, prefix: str | None) -> bool:
        """Whether output that follows `prefix` (the prompt's text after its last message; None:
        not known) is reasoning from its first token."""
        if prefix is None:
            return self.reasons_by_default
        start, end = prefix.rfind(self.start_tag), prefix.rfind(self.end_tag)
        if start < 0 and end < 0:
            return self.reasons_by_default
        return start > end

    def splitter(self, in_reasoning: bool) -> ReasoningSplitter:
        return ReasoningSplitter(self.start_tag, self.end_tag, in_reasoning)

    def count_reasoning_tokens(
        self, token_ids: Sequence[int], in_reasoning: bool, decode: Callable[[list[int]], str]
    ) -> int:
        """The output tokens between the start of reasoning and the end tag, tags not counted.

        The same rule the text splitter follows, on ids: a start tag that only whitespace comes
        before opens reasoning; otherwise reasoning runs from the first token when the prompt left
        it open; it ends at the first end tag (or the end of the output).
        """
        ids = list(token_ids)
        at = _find(ids, self.start_ids, 0)
        if at >= 0 and not decode(ids[:at]).strip():
            begin = at + len(self.start_ids)
        elif in_reasoning:
            begin = 0
        else:
            return 0
        end = _find(ids, self.end_ids, begin)
        return (len(ids) if end < 0 else end) - begin


def _find(ids: list[int], needle: tuple[int, ...], start: int) -> int:
    if not needle:
        return -1
    if len(needle) == 1:
        try:
            return ids.index(needle[0], start)
        except ValueError:
            return -1
    for i in range(start, len(ids) - len(needle) + 1):
        if tuple(ids[i : i + len(needle)]) == needle:
            return i
    return -1


_LEAD, _REASONING, _CONTENT = "lead", "reasoning", "content"


class ReasoningSplitter:
    """Splits one choice's output text as it streams in; feed() each new piece, finish() once.

    A tag may arrive split over any number of pieces: text that could still be the start of a tag
    is held back until the next piece tells (the end tag is 8 characters, so at most 7 are held).

        output:  "  <think>\\nstep 1</think>\\n\\nAnswer"
        state:   lead  |   reasoning    |  content
        parts:         "step 1"           "Answer"
    """

    def __init__(self, start_tag: str, end_tag: str, in_reasoning: bool) -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.in_reasoning = in_reasoning
        self._state = _LEAD  # before the first non-whitespace: a start tag may open the output
        self._held = ""
        self._part_start = True  # the current part has shown nothing yet: drop leading whitespace
        self.reasoning_started = False
        self.content_started = False

    def feed(self, text: str) -> Split:
        """The reasoning and answer text this piece completes (held-back text comes later)."""
        reasoning: list[str] = []
        content: list[str] = []
        data = self._held + text
        self._held = ""
        while data:
            if self._state == _LEAD:
                rest = data.lstrip()
                if not rest or (self.start_tag.startswith(rest) and rest != self.start_tag):
                    self._held = data  # whitespace, or maybe the start tag: wait for more
                    break
                if rest.startswith(self.start_tag):
                    self._enter(_REASONING)
                    data = rest[len(self.start_tag) :]
                else:
                    self._enter(_REASONING if self.in_reasoning else _CONTENT)
            elif self._state == _REASONING:
                data = self._strip_part_start(data)
                end = data.find(self.end_tag)
                if end >= 0:
                    self._show(reasoning, data[:end])
                    self._enter(_CONTENT)
                    data = data[end + len(self.end_tag) :]
                    continue
                keep = _tag_prefix_len(data, self.end_tag)
                self._show(reasoning, data[: len(data) - keep])
                self._held = data[len(data) - keep :]
                break
            else:
                self._show(content, self._strip_part_start(data))
                break
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """Flush what was held back: the output ended, so it was no tag after all."""
        held, self._held = self._held, ""
        if self._state == _LEAD:
            self._enter(_REASONING if self.in_reasoning else _CONTENT)
        if self._state == _REASONING:
            return Split(reasoning=self._strip_part_start(held))
        return Split(content=self._strip_part_start(held))

    def _enter(self, state: str) -> None:
        self._state = state
        self._part_start = True
        if state == _REASONING:
            self.reasoning_started = True
        else:
            self.content_started = True

    def _strip_part_start(self, data: str) -> str:
        return data.lstrip() if self._part_start else data

    def _show(self, out: list[str], text: str) -> None:
        if text:
            out.append(text)
            self._part_start = False


def _tag_prefix_len(data: str, tag: str) -> int:
    """The length of the longest end of `data` that is a proper prefix of `tag`."""
    longest = min(len(tag) - 1, len(data))
    if tag[0] not in data[len(data) - longest :]:
        return 0  # the common case: no "<" near the end
    for n in range(longest, 0, -1):
        if tag.startswith(data[-n:]):
            return n
    return 0


@dataclass(slots=True)
class ReasoningResult:
    """A whole choice's output, split (non-streaming)."""

    reasoning_content: str | None
    content: str | None


def split_output(parser: ReasoningParser, text: str, in_reasoning: bool) -> ReasoningResult:
    """The reasoning and answer of a complete output; a part that never started is None."""
    splitter = parser.splitter(in_reasoning)
    first, last = splitter.feed(text), splitter.finish()
    return ReasoningResult(
        first.reasoning + last.reasoning if splitter.reasoning_started else None,
        first.content + last.content if splitter.content_started else None,
    )


def generation_prefix(
    render: Callable[..., str],
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any],
) -> str | None:
    """The prompt's text after its last message: what the template writes to start the answer
    (R1: "<｜Assistant｜><think>\\n"), or the assistant message being continued. None when the
    template's output with the generation prompt does not start with the one without it."""
    if continue_final_message and messages and messages[-1]["role"] == "assistant":
        return str(messages[-1].get("content") or "")
    if not add_generation_prompt:
        return ""
    try:
        with_prompt = render(messages, add_generation_prompt=True, **template_kwargs)
        without = render(messages, add_generation_prompt=False, **template_kwargs)
    except ValueError:
        return None
    return with_prompt[len(without) :] if with_prompt.startswith(without) else None


def resolve_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser | None:
    """The parser server.reasoning_parser names for this tokenizer; None for "none".

    "auto" picks from the chat template: none unless it names a think tag; then qwen3 for a
    ChatML template (Qwen3 may answer without thinking), deepseek_r1 otherwise (R1, its distills,
    QwQ). A tag that is a special token would be dropped by detokenizing before any
    split could see it: a named parser raises ValueError then, "auto" picks none.
    """
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"server.reasoning_parser={name!r} is invalid: expected one of "
            f"{', '.join(REASONING_PARSERS)}"
        )
    if name == "none":
        return None
    chosen = name
    if name == "auto":
        template = tokenizer.chat_template or ""
        # The first R1 templates only name </think> (to strip earlier answers' reasoning).
        if START_TAG not in template and END_TAG not in template:
            return None
        chosen = "qwen3" if "<|im_start|>" in template else "deepseek_r1"
    start_ids = tuple(tokenizer.encode(START_TAG, add_special_tokens=False))
    end_ids = tuple(tokenizer.encode(END_TAG, add_special_tokens=False))
    special = set(tokenizer.all_special_ids)
    for tag, ids in ((START_TAG, start_ids), (END_TAG, end_ids)):
        if len(ids) == 1 and ids[0] in special:
            why = (
                f"{tag} is a special token of this tokenizer (id {ids[0]}), which detokenizing "
                "drops, so it never reaches the parser"
            )
            if name == "auto":
                log.warning("reasoning parser: none (%s)", why)
                return None
            raise ValueError(
                f"server.reasoning_parser={name!r} cannot work: {why}; use --reasoning-parser none"
            )
    log.info(
        "reasoning parser: %s (%s ids %s, %s ids %s)",
        chosen,
        START_TAG,
        start_ids,
        END_TAG,
        end_ids,
    )
    return ReasoningParser(chosen, REASONS_BY_DEFAULT[chosen], start_ids, end_ids)


@dataclass(frozen=True, slots=True)
class ChatReasoning:
    """One chat request's split: the server's parser and where this request's output starts."""

    parser: ReasoningParser
    in_reasoning: bool
    decode: Callable[[list[int]], str]

    @staticmethod
    def of(parser: ReasoningParser | None, req: ChatCompletionRequest, tokenizer: Any):
        """None when the server has no reasoning parser (-> ChatReasoning | None)."""
        if parser is None:
            return None
        cont = bool(req.continue_final_message)
        prefix = generation_prefix(
            tokenizer.apply_chat_template,
            [_message_dict(m) for m in req.messages],
            # As inputs.chat_input renders it: continuing a message adds no generation prompt.
            add_generation_prompt=bool(req.add_generation_prompt) and not cont,
            continue_final_message=cont,
            template_kwargs=dict(req.chat_template_kwargs or {}),
        )
        return ChatReasoning(parser, parser.starts_in_reasoning(prefix), tokenizer.decode)

    def split(self, text: str) -> ReasoningResult:
        """A whole answer split; `content` is what a tool-call parser should read."""
        return split_output(self.parser, text, self.in_reasoning)

    def message(self, text: str) -> ChatResponseMessage:
        """A whole answer as its response message: reasoning apart from content."""
        out = self.split(text)
        reasoning = out.reasoning_content
        return ChatResponseMessage(
            content=out.content, reasoning_content=reasoning, reasoning=reasoning
        )

    def splitter(self) -> ReasoningSplitter:
        return self.parser.splitter(self.in_reasoning)

    @staticmethod
    def feed(splitter: ReasoningSplitter, text: str, finished: bool) -> Split:
        """One piece of a choice's stream split (held-back text flushed when it is the last)."""
        split = splitter.feed(text)
        if finished:
            last = splitter.finish()
            split = Split(split.reasoning + last.reasoning, split.content + last.content)
        return split

    def deltas(self, splitter: ReasoningSplitter, text: str, finished: bool) -> list[DeltaMessage]:
        """The stream deltas one piece of a choice's text makes: reasoning first, then content,
        each in its own delta (clients that read one field per chunk see both); [] when all of
        it is held back."""
        split = self.feed(splitter, text, finished)
        out = []
        if split.reasoning:
            out.append(DeltaMessage(reasoning_content=split.reasoning, reasoning=split.reasoning))
        if split.content:
            out.append(DeltaMessage(content=split.content))
        return out

    def details(self, token_ids: Iterable[Sequence[int]]) -> CompletionTokensDetails:
        """usage.completion_tokens_details over every choice's output token ids."""
        count = self.parser.count_reasoning_tokens
        total = sum(count(ids, self.in_reasoning, self.decode) for ids in token_ids)
        return CompletionTokensDetails(reasoning_tokens=total)
