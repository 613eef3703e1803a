"""IncrementalDetokenizer: turns a growing token sequence into text deltas without broken UTF-8."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# How many prompt tokens to decode as left context for the first output token, so SentencePiece's
# "strip the leading space of the first token" does not eat the space of the first output word.
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, so at most 3 more tokens reach back to its first byte.
_MAX_CONTINUATION_TOKENS = 3
_REPLACEMENT = "\ufffd"


class DecodesTokens(Protocol):
    """What the detokenizer needs from a tokenizer (tidal.loader.tokenizer.Tokenizer has both)."""

    @property
    def all_special_ids(self) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Emits each new token's text once it is complete.

    Two offsets into `token_ids` make the window that is decoded each step::

        | ... older tokens ... | prefix window | read ... | new tokens |
                               ^prefix_offset  ^read_offset

    `decode(ids[prefix:read])` is the text already emitted for that window; `decode(ids[prefix:])`
    is the same plus the new text. Decoding a window (not only the new tokens) keeps word-initial
    spaces and multi-token characters right. If the new text ends in U+FFFD the trailing bytes are
    an incomplete UTF-8 character (byte-fallback or byte-level pieces): nothing is emitted and the
    offsets stay, so the next token re-decodes them. `flush()` releases such a tail at the end.
    """

    def __init__(
        self,
        tokenizer: DecodesTokens,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt tail is ever decoded; keep just that much of it.
        keep = _PROMPT_CONTEXT_TOKENS + _MAX_CONTINUATION_TOKENS
        self.token_ids: list[int] = list(prompt_token_ids[-keep:]) if keep else []
        self.prefix_offset = max(len(self.token_ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        # NOTE: a window that starts inside a multi-byte character decodes as U+FFFD, and a
        # ByteFallback decoder then marks the whole byte run invalid, new bytes included; step back
        # to the character's first byte.
        while self.prefix_offset > 0 and self._window_text().startswith(_REPLACEMENT):
            self.prefix_offset -= 1

    def append(self, token_id: int) -> str:
        """Adds one token; returns the text that became final (possibly "")."""
        self.token_ids.append(token_id)
        return self._advance(allow_incomplete=False)

    def flush(self) -> str:
        """Returns the held-back tail (an incomplete character decodes to U+FFFD), at finish."""
        return self._advance(allow_incomplete=True)

    def _window_text(self) -> str:
        window = self.token_ids[self.prefix_offset : self.read_offset]
        return self.tokenizer.decode(window, self.skip_special_tokens)

    def _advance(self, allow_incomplete: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = self._window_text()
        new_text = decode(self.token_ids[self.prefix_offset :], skip)
        if len(new_text) <= len(prefix_text):
            # Only skipped specials (or pieces that decode to nothing) so far: nothing to emit.
            return ""
        if new_text.endswith(_REPLACEMENT) and not allow_incomplete:
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        # Tokens left of the window are never decoded again; drop them so the list stays short.
        del self.token_ids[: self.prefix_offset]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        return delta
