"""The decode-only tokenizer (tidal.loader.token_decoder) against `tokenizers`' own decode: every
decoder step it implements, on tiny tokenizers built here and on the bundled Gemma vocabulary,
both skip modes, plus the fallback to the full tokenizer when a step is not implemented."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models

from tests.loader.test_tokenizer import (
    BPE_TEXTS,
    CASES,
    _byte_level_gguf,
    _sentencepiece_gguf,
    write_sentencepiece_gguf,
)
from tidal.loader import compact_cache, token_decoder, tokenizer
from tidal.loader.token_decoder import (
    CACHE_SUFFIX,
    TokenDecoder,
    UnsupportedDecoder,
    check_token_decoder,
    compact_tokenizer,
    load_token_decoder,
)
from tidal.loader.tokenizer import Tokenizer, load_tokenizer

pytest.importorskip("gguf")

_BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]
# Pieces that exercise each step: SentencePiece spaces, byte-level characters ("Ġ" is a space,
# "Ã" + "©" is "é"), runs of the strip character, and characters no byte alphabet has.
_PIECES = ["▁", "▁▁", "a", "▁hello", "world▁", "Ġ", "Ġworld", "Ã", "©", "  x  ", " ", "日本", "é"]
_SPECIALS = ["<s>", "</s>", "<turn>"]


def _tiny(decoder: decoders.Decoder | None) -> Tokenizer:
    """A tokenizer with byte pieces, ordinary pieces, special and non-special added tokens."""
    vocab = {t: i for i, t in enumerate([*_BYTE_PIECES, *_PIECES])}
    hf = tokenizers.Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    if decoder is not None:
        hf.decoder = decoder
    hf.add_special_tokens([AddedToken(t, special=True) for t in _SPECIALS])
    hf.add_tokens([AddedToken("<tool>", special=False), AddedToken("▁added", special=False)])
    return Tokenizer(
        hf,
        bos_token_id=hf.token_to_id("<s>"),
        eos_token_id=hf.token_to_id("</s>"),
        pad_token_id=None,
        add_bos_token=True,
    )


def _windows(tok: Tokenizer, n: int = 3000, seed: int = 1) -> list[list[int]]:
    """Random windows that favour the interesting ids: byte runs (valid and not), specials."""
    size = tok.vocab_size
    rng = random.Random(seed)
    utf8 = [0xE6, 0x97, 0xA5, 0xC3, 0xA9]  # "日" and "é" as bytes: runs cut anywhere
    interesting = [*utf8, 0x41, 0xFF, *range(256, size)]
    cases = [[i] for i in range(size)]
    for _ in range(n):
        length = rng.randint(1, 9)
        cases.append([rng.choice(interesting) for _ in range(length)])
    return cases


DECODERS = {
    "none": None,
    "sentencepiece": decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    ),
    "gemma": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
    "byte_level": decoders.ByteLevel(),
    "metaspace_always": decoders.Metaspace("▁", prepend_scheme="always"),
    "metaspace_first": decoders.Metaspace("▁", prepend_scheme="first"),
    "metaspace_never": decoders.Metaspace("▁", prepend_scheme="never"),
    # NOTE: tokenizers panics on a Strip from both ends over a token made only of its character,
    # and on a stop count longer than a token.
    "strip_start": decoders.Strip(" ", 2, 0),
    "strip_stop": decoders.Strip(" ", 0, 1),
    "fuse": decoders.Fuse(),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decodes_as_tokenizers_does(name: str) -> None:
    tok = _tiny(DECODERS[name])
    dec = TokenDecoder.from_tokenizer(tok, lambda: tok)
    cases = _windows(tok)
    for skip in (False, True):
        expected = tok.hf.decode_batch(cases, skip_special_tokens=skip)
        got = [dec.decode(ids, skip) for ids in cases]
        mismatches = [(c, g, e) for c, g, e in zip(cases, got, expected, strict=True) if g != e]
        assert not mismatches[:5], (name, skip)
    assert check_token_decoder(dec, tok) is None
    # Ids with no token are dropped, as tokenizers drops them.
    assert dec.decode([tok.vocab_size + 5, 256 + _PIECES.index("a")]) == tok.hf.decode([256 + 2])


def test_carries_the_special_ids_and_refuses_to_encode() -> None:
    tok = _tiny(DECODERS["gemma"])
    dec = compact_tokenizer(tok, lambda: tok)
    assert isinstance(dec, TokenDecoder)
    assert dec.eos_token_ids == tok.eos_token_ids and dec.all_special_ids == tok.all_special_ids
    assert (dec.bos_token_id, dec.vocab_size) == (tok.bos_token_id, tok.vocab_size)
    assert dec.load_full() is tok
    with pytest.raises(TypeError, match="only decodes"):
        dec.encode("hello")


def test_unsupported_decoder_keeps_the_full_tokenizer() -> None:
    wordpiece = _tiny(decoders.WordPiece())
    with pytest.raises(UnsupportedDecoder, match="WordPiece"):
        TokenDecoder.from_tokenizer(wordpiece, lambda: wordpiece)
    assert "WordPiece" in compact_tokenizer(wordpiece, lambda: wordpiece)
    regex = _tiny(decoders.Replace(tokenizers.Regex("▁+"), " "))
    assert "Replace" in compact_tokenizer(regex, lambda: regex)


def test_a_decoder_that_differs_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _tiny(DECODERS["gemma"])
    monkeypatch.setattr(TokenDecoder, "decode", lambda self, ids, skip=True: "wrong")
    assert "differently" in compact_tokenizer(tok, lambda: tok)


def test_a_vocabulary_spelling_a_token_twice_keeps_its_last_ids(tmp_path: Path) -> None:
    """Two ids spell "a": tokenizers' vocabulary map holds one entry fewer than the file has
    ids, so its size is no id bound. The ids run to the largest; the last ones decode as the
    full tokenizer decodes them, and the check refuses a table cut short."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab", "a", "c", "cc", "<|end|>"]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 3]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, -0.5, -1.0, -1.0, -0.7, 0.0]
    path = write_sentencepiece_gguf(tmp_path / "dup.gguf", "llama", tokens, types, scores, False)
    full = load_tokenizer(path)
    last = len(tokens) - 1
    assert full.hf.get_vocab_size(with_added_tokens=True) < len(tokens) == full.vocab_size
    dec = compact_tokenizer(full, lambda: full)
    assert isinstance(dec, TokenDecoder) and dec.vocab_size == len(tokens)
    for ids in ([last], [8, last], [3, 6, 8], [5, last - 1, 4]):
        for skip in (False, True):
            assert dec.decode(ids, skip) == full.hf.decode(ids, skip_special_tokens=skip), ids
    full.vocab_size = last  # as before: the count of the vocabulary map's entries
    short = TokenDecoder.from_tokenizer(full, lambda: full)
    full.vocab_size = len(tokens)
    assert check_token_decoder(short, full) == [last]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_gguf_tokenizers(tmp_path: Path, kind: str) -> None:
    if kind == "byte_level":
        path, texts = _byte_level_gguf(tmp_path / "bpe.gguf", "qwen2"), BPE_TEXTS
    else:
        path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
        texts = ["hello world", "hello  world", " hello", "héllo", "world<|turn|>hello"]
    full = load_tokenizer(path)
    dec = load_token_decoder(path)
    assert isinstance(dec, TokenDecoder)
    for text in texts:
        ids = full.encode(text)
        for skip in (False, True):
            assert dec.decode(ids, skip) == full.decode(ids, skip), (text, skip)
            # Every prefix too: the incremental detokenizer decodes windows cut anywhere.
            for end in range(len(ids)):
                assert dec.decode(ids[:end], skip) == full.decode(ids[:end], skip)


def test_bundled_gemma(tmp_path: Path) -> None:
    from tidal.loader.bundled import bundled_model_path

    path = bundled_model_path()
    full = load_tokenizer(path)
    dec = load_token_decoder(path)
    assert isinstance(dec, TokenDecoder)
    assert dec.nbytes < 8 * 2**20  # ~4.2 MiB for 262,144 tokens
    assert check_token_decoder(dec, full, seed=7) is None
    for text in CASES:
        ids = full.encode(text)
        for skip in (False, True):
            assert dec.decode(ids, skip) == full.decode(ids, skip), (text, skip)


def test_cache_is_read_back_and_keyed_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
    first = load_token_decoder(path)
    cache = path.with_name(path.name + CACHE_SUFFIX)
    assert isinstance(first, TokenDecoder) and cache.is_file()

    def no_full_load(*args: object) -> None:
        raise AssertionError("the cached decoder should not need the full tokenizer")

    monkeypatch.setattr(tokenizer, "load_tokenizer", no_full_load)
    again = load_token_decoder(path)
    assert isinstance(again, TokenDecoder)
    ids = list(range(first.vocab_size + 2))
    for skip in (False, True):
        assert again.decode(ids, skip) == first.decode(ids, skip)
    assert again.attrs == first.attrs and again.eos_token_ids == first.eos_token_ids
    monkeypatch.undo()

    # Another family asked for, or a corrupt file: a miss, rebuilt and rewritten.
    assert load_token_decoder(path, family="chatml").family == "chatml"
    cache.write_bytes(cache.read_bytes()[:-3])
    assert isinstance(load_token_decoder(path), TokenDecoder)
    assert isinstance(load_token_decoder(path).load_full(), Tokenizer)


def test_cached_refusal_keeps_the_full_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
    monkeypatch.setattr(token_decoder, "compact_tokenizer", lambda tok, load: "not reproducible")
    assert isinstance(load_token_decoder(path), Tokenizer)
    monkeypatch.undo()
    # The refusal is cached: no second build attempt while the file is unchanged.
    monkeypatch.setattr(token_decoder, "compact_tokenizer", lambda tok, load: 1 / 0)
    assert isinstance(load_token_decoder(path), Tokenizer)


def test_unwritable_model_directory_uses_the_cache_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    real_write = compact_cache._write_cache

    def refuse_beside(cache_path: Path, key: dict, result: object) -> bool:
        return False if cache_path.parent == tmp_path else real_write(cache_path, key, result)

    monkeypatch.setattr(compact_cache, "_write_cache", refuse_beside)
    assert isinstance(load_token_decoder(path), TokenDecoder)
    assert list((tmp_path / "cache" / "tokenizers").glob(f"spm.gguf-*{CACHE_SUFFIX}"))
