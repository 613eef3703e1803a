"""Engine logprob entries -> the completions (parallel lists) and chat (per-token objects) logprob shapes."""

from __future__ import annotations

from collections.abc import Sequence

from tidal.engine.output import Logprob
from tidal.server.responses import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)

Entry = dict[int, Logprob] | None


def _text(tid: int, entry: Entry, tokenizer) -> str:
    lp = None if entry is None else entry.get(tid)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid], skip_special_tokens=False)


def _top(entry: Entry, num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` best alternatives, best first (the chosen token is in it only by rank)."""
    if entry is None or num_top <= 0:
        return []
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top]
    return sorted(ranked, key=lambda item: item[1].rank or 0)[:num_top]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Entry],
    num_top: int,
    tokenizer,
    text_offset: int = 0,
    into: CompletionLogProbs | None = None,
) -> CompletionLogProbs:
    """Append one entry per token to `into` (or a new object); offsets start at `text_offset`."""
    out = into if into is not None else CompletionLogProbs()
    offset = text_offset
    for tid, entry in zip(token_ids, entries):
        token = _text(tid, entry, tokenizer)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        chosen = None if entry is None else entry.get(tid)
        out.token_logprobs.append(None if chosen is None else chosen.logprob)
        if entry is None:
            out.top_logprobs.append(None)
        else:
            top = {_text(t, entry, tokenizer): lp.logprob for t, lp in _top(entry, num_top)}
            if chosen is not None:
                top.setdefault(
                    token, chosen.logprob
                )  # OpenAI/vLLM: the sampled token is listed too
            out.top_logprobs.append(top)
    return out


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry], num_top: int, tokenizer
) -> ChatChoiceLogprobs:
    content: list[ChatTokenLogprob] = []
    for tid, entry in zip(token_ids, entries):
        token = _text(tid, entry, tokenizer)
        chosen = None if entry is None else entry.get(tid)
        top = [
            TopLogprob(
                token=(s := _text(t, entry, tokenizer)), logprob=lp.logprob, bytes=list(s.encode())
            )
            for t, lp in _top(entry, num_top)
        ]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=-9999.0 if chosen is None else chosen.logprob,
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)
