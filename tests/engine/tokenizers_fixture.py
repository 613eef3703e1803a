"""Two small real tokenizers for engine tests: byte-level BPE and SentencePiece-style byte fallback."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SENTENCES = [
    "Hello world, this is a test of the tidal engine.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming text arrives token by token; stop strings end it early.",
    "Numbers like 1234 and 56 and symbols such as #, $ and % appear too.",
] * 4
SPECIALS = ["<unk>", "<s>", "</s>"]


class TokenizerAdapter:
    """The two members the detokenizer and OutputState need, over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.all_special_ids = [tok.token_to_id(s) for s in SPECIALS]
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, piece: str) -> int:
        tid = self.tok.token_to_id(piece)
        assert tid is not None, piece
        return tid


@functools.cache
def byte_level_bpe() -> TokenizerAdapter:
    """GPT-2 style: every byte is a base symbol, merges learned from SENTENCES."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return TokenizerAdapter(tok)


@functools.cache
def sentencepiece_byte_fallback() -> TokenizerAdapter:
    """Llama-2 style: "▁" marks word starts, unknown characters fall back to <0xNN> byte pieces."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(
        SENTENCES, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS)
    )
    spec = json.loads(base.to_str())
    vocab: dict[str, int] = {}
    for piece in SPECIALS + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[piece] = len(vocab)
    for piece in sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in spec["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return TokenizerAdapter(tok)
