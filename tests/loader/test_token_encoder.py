"""The compact encoding tokenizer (tidal.loader.token_encoder) against `tokenizers`: random
SentencePiece vocabularies with tied scores built here, with and without byte pieces, the
bundled Gemma 3 vocabulary, the fallback to the full tokenizer, and the on-disk cache."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.loader.test_tokenizer import (
    CASES,
    _byte_level_gguf,
    _sentencepiece_gguf,
    write_sentencepiece_gguf,
)
from tidal.loader import token_encoder, tokenizer
from tidal.loader.token_encoder import (
    CompactTokenizer,
    check_encoder,
    compact_encoding_tokenizer,
    load_compact_tokenizer,
)
from tidal.loader.tokenizer import Tokenizer, load_tokenizer

pytest.importorskip("gguf")
if token_encoder._library() is None:
    pytest.skip("no C compiler: the compact tokenizer is off", allow_module_level=True)

_ALPHABET = ["a", "b", "c", "\u2581", "\u00e9", "\u65e5"]


def _random_spm_gguf(
    path: Path, seed: int, byte_pieces: bool, arch: str = "llama", duplicate: bool = False
) -> Path:
    """A SentencePiece vocabulary of random pieces over a small alphabet, scores drawn from a
    few values (so many tie), control and user-defined tokens; `duplicate` spells one twice."""
    rng = random.Random(seed)
    pieces: list[str] = list(_ALPHABET)
    while len(pieces) < 300:
        piece = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(2, 6)))
        if piece not in pieces:
            pieces.append(piece)
    if duplicate:
        pieces.append(pieces[40])
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if byte_pieces else []
    user = ["<tag>", "\n", "\n\n"]
    tokens = [*specials, *byte_tokens, *pieces, "<|turn|>", *user]
    types = [2, 3, 3, *([6] * len(byte_tokens)), *([1] * len(pieces)), 3, *([4] * len(user))]
    scores = [0.0] * (3 + len(byte_tokens))
    scores += [float(-rng.randint(0, 12)) for _ in pieces]
    scores += [0.0] * (1 + len(user))

    return write_sentencepiece_gguf(path, arch, tokens, types, scores, add_space_prefix=False)


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    chars = ["a", "b", "c", " ", "\u00e9", "\u65e5", "x", "\n", "\U0001f30a", "<tag>", "<|turn|>"]
    return ["".join(rng.choice(chars) for _ in range(rng.randint(0, 30))) for _ in range(n)]


@pytest.mark.parametrize("byte_pieces", [True, False], ids=["byte-fallback", "unk"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_vocabularies_encode_as_tokenizers_does(
    tmp_path: Path, seed: int, byte_pieces: bool
) -> None:
    path = _random_spm_gguf(tmp_path / "spm.gguf", seed, byte_pieces)
    full = load_tokenizer(path)
    compact = load_compact_tokenizer(path)
    assert isinstance(compact, CompactTokenizer)
    assert check_encoder(compact, full, seed=seed + 10) is None
    for text in _random_texts(seed, 2000):
        for special in (False, True):
            assert compact.encode(text, special) == full.encode(text, special), repr(text)


def test_the_same_surface_as_the_full_tokenizer(tmp_path: Path) -> None:
    path = _random_spm_gguf(tmp_path / "spm.gguf", 5, True, arch="gemma3")
    full = load_tokenizer(path, family="gemma")
    compact = load_compact_tokenizer(path, family="gemma")
    assert isinstance(compact, CompactTokenizer)
    ids = list(range(full.vocab_size))
    assert compact.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compact.convert_ids_to_tokens([full.vocab_size])
    for token in ["a", "<s>", "<tag>", "\n\n", "<|turn|>", "nope", ""]:
        assert compact.token_to_id(token) == full.token_to_id(token), token
    assert (compact.bos_token, compact.eos_token) == (full.bos_token, full.eos_token)
    assert compact.all_special_ids == full.all_special_ids
    assert compact.eos_token_ids == full.eos_token_ids
    messages = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "b a"}]
    text = compact.apply_chat_template(messages)
    assert text == full.apply_chat_template(messages)
    assert compact.encode(text, False) == full.encode(text, False)
    assert compact.decode(compact.encode(text, False), False) == full.decode(
        full.encode(text, False), False
    )
    assert isinstance(compact.load_full(), Tokenizer) and compact.hf is compact.load_full().hf


def test_bundled_gemma() -> None:
    from tidal.loader.arch_reader import read_arch_config
    from tidal.loader.bundled import bundled_model_path

    path = bundled_model_path()
    # The family `tidal serve` asks for, so this test and a server share one cache file.
    family = read_arch_config(path).family
    full = load_tokenizer(path, family)
    compact = load_compact_tokenizer(path, family)
    assert isinstance(compact, CompactTokenizer)
    assert compact.nbytes < 8 * 2**20  # ~5.2 MiB for 262,144 tokens
    assert check_encoder(compact, full, seed=11) is None
    for text in CASES:
        assert compact.encode(text) == full.encode(text), text
    messages = [{"role": "user", "content": "Write a haiku about the tide."}]
    prompt = compact.apply_chat_template(messages)
    assert compact.encode(prompt, False) == full.encode(prompt, False)


@pytest.mark.parametrize("kind", ["space_prefix", "byte_level", "duplicate"])
def test_other_vocabularies_keep_the_full_tokenizer(tmp_path: Path, kind: str) -> None:
    if kind == "space_prefix":  # Metaspace pre-tokenizer: not what spm_bpe.c implements
        path = _sentencepiece_gguf(tmp_path / "spm.gguf", True)
    elif kind == "duplicate":  # two ids spell one piece: which one encodes is tokenizers' pick
        path = _random_spm_gguf(tmp_path / "spm.gguf", 0, True, duplicate=True)
    else:
        path = _byte_level_gguf(tmp_path / "bpe.gguf", "qwen2")
    assert isinstance(load_compact_tokenizer(path), Tokenizer)


def test_an_encoder_that_differs_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _random_spm_gguf(tmp_path / "spm.gguf", 3, True)
    full = load_tokenizer(path)
    real = CompactTokenizer._encode

    def off_by_one(self: CompactTokenizer, text: str) -> list[int]:
        ids = real(self, text)
        return ids[:-1] if len(ids) > 3 else ids

    monkeypatch.setattr(CompactTokenizer, "_encode", off_by_one)
    verdict = compact_encoding_tokenizer(full, path, lambda: full)
    assert isinstance(verdict, str) and "encodes" in verdict
    # Built here: a child process would not see the patch.
    assert isinstance(load_compact_tokenizer(path, build_elsewhere=False), Tokenizer)


def test_the_first_load_builds_in_a_child_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that loads a model's tokenizer for the first time gets the compact one without
    ever holding (or importing) the full one: a child builds and caches it. A child that fails
    leaves the build to the process itself."""
    path = _random_spm_gguf(tmp_path / "spm.gguf", 7, True)
    script = (
        "import sys\n"
        "from tidal.loader.token_encoder import load_compact_tokenizer\n"
        "tok = load_compact_tokenizer(sys.argv[1])\n"
        "print(type(tok).__name__, 'tokenizers' in sys.modules, tok.encode('abc b\u00e9'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = load_tokenizer(path)
    assert proc.stdout.split(" ", 2) == ["CompactTokenizer", "False", f"{full.encode('abc bé')}\n"]
    assert path.with_name(path.name + CompactTokenizer.CACHE_SUFFIX).is_file()

    other = _random_spm_gguf(tmp_path / "other.gguf", 8, True)
    monkeypatch.setattr(token_encoder, "_BUILD_COMMAND", (sys.executable, "-c", "exit(3)"))
    with caplog.at_level("WARNING", logger="tidal.loader.token_decoder"):
        assert isinstance(load_compact_tokenizer(other), CompactTokenizer)
    assert "failed (exit 3)" in caplog.text


def test_cache_is_read_back_and_keyed_to_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _random_spm_gguf(tmp_path / "spm.gguf", 4, True)
    first = load_compact_tokenizer(path)
    cache = path.with_name(path.name + CompactTokenizer.CACHE_SUFFIX)
    assert isinstance(first, CompactTokenizer) and cache.is_file()

    def no_full_load(*args: object) -> None:
        raise AssertionError("the cached tokenizer should not need the full one")

    monkeypatch.setattr(tokenizer, "load_tokenizer", no_full_load)
    again = load_compact_tokenizer(path)
    assert isinstance(again, CompactTokenizer)
    for text in _random_texts(4, 300):
        assert again.encode(text) == first.encode(text)
    assert again.chat_template == first.chat_template
    # A changed encoding kernel is a miss: checked against the full tokenizer again.
    monkeypatch.setattr(token_encoder, "_kernel_digest", lambda: "changed")
    with pytest.raises(AssertionError, match="should not need"):
        load_compact_tokenizer(path)
    monkeypatch.undo()
    assert isinstance(load_compact_tokenizer(path), CompactTokenizer)


def test_without_the_kernel_the_full_tokenizer_serves_and_nothing_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _random_spm_gguf(tmp_path / "spm.gguf", 6, True)
    monkeypatch.setattr(token_encoder, "_library", lambda: None)
    assert isinstance(load_compact_tokenizer(path), Tokenizer)
    assert not path.with_name(path.name + CompactTokenizer.CACHE_SUFFIX).exists()
    monkeypatch.undo()
    assert isinstance(load_compact_tokenizer(path), CompactTokenizer)
