"""Every llama.cpp pre-tokenizer name: tiny GGUFs against transformers, or llama.cpp's rule by hand."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers, trainers
from tokenizers.models import BPE

from tidal.loader.tokenizer import load_tokenizer
from tidal.loader.tokenizer_pre import PRE_TOKENIZER_RULES, split_pre_tokenizer

gguf = pytest.importorskip("gguf")

# Digits, code, CJK, emoji, whitespace runs, contractions, case changes, combining marks, CRLF.
CORPUS = [
    "Hello world! It's 2024; we'll pay $1,234,567.89 (or 12345678) by 3pm.",
    "def fn(x: int) -> int:\n    return x**2  # square\n\n\tpass\r\n",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji 🤖🎉👍🏽 and café naïve Ångström e\u0301 résumé",
    "camelCaseWords and HTTPServer, iPhone XML2JSON they're I'M YOU'VE",
    "   leading spaces, trailing   \n\n\n   blank lines   ",
    "a+b=c; x<y>z ^~| `tick` @user #tag 50% 3.14159 -42 1e10 0x1F",
    "Привет, мир! Γειά σου Κόσμε 123 ١٢٣ ༣",
    "<think>reasoning</think> answer<|endoftext|>next <|im_end|>",
    "IMGIMGABZ <sentinel:12> İstanbul'da New York 9876543210",
]
SPECIALS = [("<|endoftext|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4)]


@functools.lru_cache(maxsize=1)
def _trained_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE trained on the corpus with NO pre-split, so merges cross every boundary
    a pre-tokenizer might draw: a wrong split shows up as different ids."""
    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=900, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    state = tok.to_str()
    import json

    model = json.loads(state)["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _gguf_with_pre(path: Path, pre: str) -> Path:
    tokens, merges = _trained_vocab()
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([*tokens, *(t for t, _ in SPECIALS)])
    writer.add_token_types([1] * len(tokens) + [k for _, k in SPECIALS])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens))
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Names for which transformers builds the same tokenizer from a GGUF: it knows their split
# regexes, or (the GPT-2 names) its byte-level default is llama.cpp's rule for them.
TRANSFORMERS_BUILDS = [
    *("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
    *("jina-v5-nano", "dbrx", "smaug-bpe", "tekken", "qwen2", "deepseek-r1-qwen", "kormo"),
    *("f2llmv2", "megrez", "qwen35", "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    *("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0"),
    *("mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt"),
    *("olmo", "jais", "trillion", "granite-docling"),
]


@pytest.mark.parametrize("pre", TRANSFORMERS_BUILDS)
def test_pre_tokenizer_matches_transformers(tmp_path: Path, pre: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = _gguf_with_pre(tmp_path / f"{pre}.gguf", pre)
    ours = load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in CORPUS:
        assert ours.encode(text) == ref(text)["input_ids"], (pre, text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_the_corpus_tells_the_rules_apart(tmp_path: Path) -> None:
    """The oracle test only means something if different rules give different ids here."""
    encoded = {}
    for pre in ("gpt-2", "llama3", "qwen2", "tekken", "gpt-4o", "qwen35", "smollm", "default"):
        tok = load_tokenizer(_gguf_with_pre(tmp_path / f"{pre}.gguf", pre))
        encoded[pre] = tuple(tuple(tok.encode(t)) for t in CORPUS)
    assert len(set(encoded.values())) == len(encoded)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_RULES))
def test_every_name_builds_and_round_trips(tmp_path: Path, pre: str) -> None:
    if not PRE_TOKENIZER_RULES[pre].byte_level:
        pytest.skip("raw UTF-8 vocabularies: see test_raw_utf8_rules")
    tok = load_tokenizer(_gguf_with_pre(tmp_path / "t.gguf", pre))
    for text in CORPUS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text, (pre, text)


# For the names transformers cannot build, the split rule of llama.cpp's vocabulary loader
# (src/llama-vocab.cpp: its list of regexes, each splitting the pieces the previous one left)
# worked by hand on a few texts.
HAND_CASES: dict[str, list[tuple[str, list[str]]]] = {
    # punctuation runs | GPT-2 | digit runs | three ASCII digits
    "default": [
        (
            "Hello, world!! 12345 a+b",
            ["Hello", ",", " world", "!!", " ", "123", "45", " a", "+", "b"],
        )
    ],
    # punctuation runs (with `) | GPT-2 | three ASCII digits
    "falcon": [("x=1234567, y`z", ["x", "=", "123", "456", "7", ",", " y", "`", "z"])],
    # every digit alone | GPT-2
    "smollm": [("abc 2024 it's", ["abc", " ", "2", "0", "2", "4", " it", "'s"])],
    # newlines | cased letters with one leading space | punctuation | trailing space | CJK | numbers
    "deepseek-llm": [
        ("Hello, World! 12 日本\n", ["Hello", ",", " World", "!", " ", "12", " ", "日本", "\n"])
    ],
    # newlines | letters | punctuation | CJK | every digit alone
    "deepseek-coder": [("foo(bar) 42", ["foo", "(", "bar", ")", " ", "4", "2"])],
    # up to three digits | CJK and kana | words that an ASCII punctuation mark may lead
    "deepseek-v3": [("x1234 日本語。Hi", ["x", "123", "4", " ", "日本語", "。", "Hi"])],
    # up to three digits | CJK | words | then every digit alone
    "spark2_5": [("x12345", ["x", "1", "2", "3", "4", "5"])],
    # Hangul, CJK punctuation, bopomofo, CJK runs apart | Tekken-like words with contractions
    "youtu": [("안녕하세요 Hello's", ["안녕하세요", " Hello's"])],
    # anything up to whitespace or sentence punctuation
    "bloom": [("Hello, world. Ok", ["Hello", ",", " world", ".", " Ok"])],
    "viking": [("ab12 c", ["ab", "1", "2", " c"])],
    # image and sentinel tokens | tab, newline, 4 or 2 spaces | digits | punctuation | GPT-2
    "chameleon": [("IMGIMGABZ  x 42!", ["IMGIMGABZ", "  ", "x", " ", "4", "2", "!"])],
    # Han runs apart from GPT-4o's case-aware words
    "kimi-k2": [("你好world 123456", ["你好", "world", " ", "123", "456"])],
    # digit runs, cut before every three digits from the right
    "superbpe": [("a1234567b", ["a", "1", "234", "567", "b"])],
    "bailingmoe": [("it's 12", ["it", "'s", " ", "1", "2"])],
    "seed-coder": [("a\n\nb 12", ["a", "\n\n", "b", " ", "1", "2"])],
    # Qwen2 without contractions: a Turkish suffix after an apostrophe stays one piece
    "ufakzeka": [("İstanbul'da 5", ["İstanbul", "'da", " ", "5"])],
    # digits grouped in threes from the right | Asian scripts | words
    "afmoe": [("x12345 日本語", ["x", "12", "345", " ", "日本語"])],
    "laguna": [("a b\n\nc", ["a", " b", "\n\n", "c"])],
    # letter runs may hold single spaces ("New York" is one piece)
    "exaone-moe": [("New York 5", ["New York", " ", "5"])],
    "minicpm5": [("abc 12345", ["abc", " ", "123", "45"])],
    # whitespace cut into 512, 256, ..., 4, 2 or 1 before a word
    "jais-2": [("a      b", ["a", "    ", " ", " b"])],
    "granite-embed-multi-97m": [("camelCase", ["camel", "Case"])],
    "tiny_aya": [("1234567 abc", ["1", "234", "567", " abc"])],
    # Llama 3's rule under other names
    "glm4": [("12345 it's", ["123", "45", " it", "'s"])],
    # Qwen2's rule under other names
    "stablelm2": [("123 ab", ["1", "2", "3", " ab"])],
    "hunyuan": [("123", ["1", "2", "3"])],
    "solar-open": [("123", ["1", "2", "3"])],
    "grok-2": [("123", ["1", "2", "3"])],
    "whitespace": [("a  b", ["a", "  ", "b"])],
    "gemma4": [("a b\n\nc", ["a b", "\n\n", "c"])],
}
# Names that share one rule object with a name above (llama.cpp maps them to one pre type).
SAME_RULE_AS = {
    "starcoder": "smollm",
    "refact": "smollm",
    "command-r": "smollm",
    "codeshell": "smollm",
    "exaone": "smollm",
    "minerva-7b": "smollm",
    "mellum2": "smollm",
    "hunyuan-dense": "deepseek-v3",
    "joyai-llm": "deepseek-v3",
    "hy_v4": "deepseek-v3",
    "poro-chat": "bloom",
    "gpt3-finnish": "bloom",
    "bailingmoe2": "bailingmoe",
    "llada-moe": "bailingmoe",
    "cohere2moe": "tiny_aya",
    "chatglm-bpe": "glm4",
    "granite-embed-multi-311m": "gemma4",
    "sarvam-moe": "gemma4",
    "gpt2": "gpt-2",
}


@pytest.mark.parametrize("pre", sorted(HAND_CASES))
def test_pre_tokenizer_rule_by_hand(pre: str) -> None:
    splitter = split_pre_tokenizer(PRE_TOKENIZER_RULES[pre])
    for text, pieces in HAND_CASES[pre]:
        assert [p for p, _ in splitter.pre_tokenize_str(text)] == pieces, (pre, text)


def test_every_name_is_checked_one_way_or_another() -> None:
    covered = set(TRANSFORMERS_BUILDS) | set(HAND_CASES) | set(SAME_RULE_AS)
    assert covered == set(PRE_TOKENIZER_RULES)
    for alias, name in SAME_RULE_AS.items():
        assert PRE_TOKENIZER_RULES[alias] == PRE_TOKENIZER_RULES[name], alias


def test_bos_defaults_follow_llama_cpp(tmp_path: Path) -> None:
    def without_bos_flag(pre: str) -> Path:
        path = tmp_path / f"{pre}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(["a", "b", "<s>"])
        writer.add_token_types([1, 1, 3])
        writer.add_token_merges([])
        writer.add_bos_token_id(2)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    # llama.cpp adds BOS by default for Llama 3, Tekken and Chameleon vocabularies only.
    expected = {"llama-bpe": True, "tekken": True, "chameleon": True, "qwen2": False, "glm4": False}
    for pre, add_bos in expected.items():
        tok = load_tokenizer(without_bos_flag(pre))
        assert tok.add_bos_token is add_bos, pre
        assert tok.encode("ab")[:1] == ([2] if add_bos else [0]), pre


def test_raw_utf8_rules(tmp_path: Path) -> None:
    """gemma4-style vocabularies: raw UTF-8 tokens, spaces written as "▁", byte fallback."""
    tokens = [
        "<unk>",
        *(f"<0x{b:02X}>" for b in range(256)),
        "a",
        "b",
        "▁",
        "a▁",
        "a▁b",
        "\n",
        "\n\n",
    ]
    path = tmp_path / "raw.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_types([2, *([6] * 256), *([1] * 7)])
    writer.add_token_merges(["a ▁", "a▁ b", "\n \n"])
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = load_tokenizer(path)
    ids = tok.encode("a b\n\nc")
    assert ids == [tokens.index("a▁b"), tokens.index("\n\n"), 1 + ord("c")]
    assert tok.decode(ids) == "a b\n\nc"


def test_unknown_pre_lists_the_supported_names(tmp_path: Path) -> None:
    path = _gguf_with_pre(tmp_path / "x.gguf", "klingon-bpe")
    with pytest.raises(ValueError, match="'klingon-bpe'.*supported: .*llama-bpe.*smollm"):
        load_tokenizer(path)
