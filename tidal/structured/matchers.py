"""GrammarMatchers: one llguidance matcher per constrained request, kept in step with its output
tokens, and the token bitmask each one allows next."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from tidal.sampling_params import StructuredOutputs
from tidal.structured.grammar import to_grammar

# Compiled grammars kept per spec: a fresh matcher is a deep copy of the cached one.
DEFAULT_CACHE_SIZE = 128


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask: bit (id % 32) of word (id // 32) allows token id."""
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class _Tracked:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0  # output tokens the matcher has advanced over


class GrammarMatchers:
    """The engine process's grammar state.

    A request's matcher is advanced lazily, to the request's kept output tokens, each time its
    next mask is needed, so it always agrees with what the engine kept: tokens dropped after a
    stop are never consumed, and a preempted request (recomputed with its outputs kept) finds
    its matcher where it left it. If the outputs ever got shorter, the matcher is rolled back.

    The llguidance tokenizer is built on the first constrained request (seconds for a 262k
    vocabulary) from `tokenizer` (tidal's loader Tokenizer: its `.hf` tokenizers.Tokenizer).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self._tracked: dict[str, _Tracked] = {}

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            source = self._source
            # A decode-only tokenizer (tidal.loader.token_decoder) loads the full one on demand.
            if getattr(source, "hf", None) is None and hasattr(source, "load_full"):
                source = source.load_full()
            self._tokenizer = _ll_tokenizer(source, self.vocab_size, self.eos_token_ids)
        return self._tokenizer

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, to_grammar(spec), log_level=0)
            if compiled.is_error():
                raise ValueError(f"invalid {spec.kind}: {compiled.get_error()}")
            self._compiled[spec] = compiled
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return compiled.deep_copy()

    def check(self, spec: StructuredOutputs) -> None:
        """Compile `spec` against the tokenizer now; ValueError naming the problem if it fails."""
        self._compile(spec)

    def fill(
        self,
        request_id: str,
        spec: StructuredOutputs,
        output_token_ids: Sequence[int],
        mask: torch.Tensor,
    ) -> None:
        """Write the request's next-token bitmask into `mask` ((words,) int32, contiguous, CPU)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            tracked = self._tracked[request_id] = _Tracked(self._compile(spec))
        m = tracked.matcher
        if tracked.num_consumed > len(output_token_ids):
            m.rollback(tracked.num_consumed - len(output_token_ids))
            tracked.num_consumed = len(output_token_ids)
        for token in output_token_ids[tracked.num_consumed :]:
            m.consume_token(token)  # never raises: an impossible token puts m in its error state
        tracked.num_consumed = len(output_token_ids)
        if m.is_error():
            # Only a token the mask forbade gets here (min_tokens suppression had nothing else):
            # allow EOS alone so the request ends rather than running on unconstrained.
            mask.zero_()
            for eos in self.eos_token_ids:
                mask[eos // 32] |= _bit(eos % 32)
            return
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())

    def release(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from the tokenizers JSON; for a decoder it cannot read (e.g. a
    Fuse of single characters) from each token's own bytes instead."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise ValueError("structured output needs the checkpoint's tokenizer (tokenizers JSON)")
    try:
        return llguidance.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=eos)
    except ValueError:
        pass
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(eos)
    tokens: list[bytes] = []
    for i in range(vocab_size):
        piece = hf.id_to_token(i)
        byte = _BYTE_PIECE.fullmatch(piece or "")
        if piece is None:
            tokens.append(b"")
        elif byte:
            tokens.append(bytes([int(byte.group(1), 16)]))
        elif i in special:
            tokens.append(piece.encode())
        else:
            tokens.append(hf.decode([i], skip_special_tokens=False).encode())

    class _Source:
        eos_token_id = eos[0]
        bos_token_id = getattr(tokenizer, "bos_token_id", None)
        special_token_ids = sorted(special)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            return hf.encode(text, add_special_tokens=False).ids

    wrapper = llguidance.TokenizerWrapper(_Source())
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


def _bit(i: int) -> int:
    # Bit 31 is the int32 sign bit.
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def unpack_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, words) int32 bitmask -> (R, vocab_size) bool, True where a token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> shifts) & 1  # (R, words, 32)
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()
