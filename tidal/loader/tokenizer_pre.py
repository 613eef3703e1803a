"""llama.cpp's `tokenizer.ggml.pre` names, each mapped to the split rule its vocabulary was trained with.

A byte-level BPE vocabulary only reproduces the model's own token ids when the text is cut into
the same pieces before merging. llama.cpp names the rule of each known vocabulary family in
`tokenizer.ggml.pre`; the rules are a list of regexes applied in turn (each splits every piece the
previous one left, keeping both the matches and the text between them). Here each becomes a
`tokenizers` `Split(behavior="isolated")`, which has the same semantics.

Where llama.cpp rewrote a model's own regex for its engine (case-insensitive groups spelled out,
Unicode classes approximated with lookaheads), the model's original regex is used: that is what
the model's own tokenizer.json, and transformers, run.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers

# ---------------------------------------------------------------- the split regexes

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# GPT-2's: contractions, letters, digits and other runs each with one optional leading space.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 (tiktoken cl100k): a letter run may take one leading non-letter, digits in threes.
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: as Llama 3 but every digit alone.
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: as Qwen2 with combining marks kept inside words.
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Tekken (Mistral Nemo): words split at lower->upper case changes; digits alone; "/" joins punctuation.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o (o200k): Tekken's case-aware words with contractions attached, digits in threes.
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Granite embedding (multilingual 97m): GPT-4o with combining marks counted as letters.
_ML = r"(?:(?=[\p{L}\p{M}])[^a-z])"  # a letter or mark that is not ASCII lower case
_MU = r"(?:(?=[\p{L}\p{M}])[^A-Z])"  # a letter or mark that is not ASCII upper case
_GRANITE_EMB = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_ML}*{_MU}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_ML}+{_MU}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Kimi K2: runs of Han characters apart, then GPT-4o's rule over everything that is not Han.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2 = (
    r"\p{Han}+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Digit runs cut in threes from the right: "1234567" -> "1", "234", "567".
_DIGITS_RIGHT_THREES = r"\d{1,3}(?=(?:\d{3})*\b)"
_NUMBERS_RIGHT_THREES = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
# DeepSeek V3 and relatives: ASCII punctuation may lead an ASCII word; marks stay in words.
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_KANA = r"[一-龥぀-ゟ゠-ヿ]+"
_CJK_HANGUL = r"[一-龥ࠀ-一가-퟿]+"


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    """A regex character class of code point ranges, written as escapes.

    NOTE: escapes, not literal characters, because several of these code points (U+1F7D, U+212A,
    U+F900, ...) are changed by Unicode normalization, which an editor may apply to source text.
    """
    return "[" + "".join(rf"\x{{{lo:X}}}-\x{{{hi:X}}}" for lo, hi in ranges) + "]"


# Cased letters (Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, ...) in DeepSeek LLM's rule.
_DEEPSEEK_LLM_LETTERS = (
    r"\s?"
    + _char_class(
        (
            *((0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA)),
            *((0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377)),
            *((0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C)),
            *((0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556)),
            *((0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA)),
            *((0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A)),
            *((0x1E00, 0x1F15), (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D)),
            *((0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D)),
            *((0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE)),
            *((0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB)),
            *((0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102)),
            *((0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D)),
            *((0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D)),
            *((0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149)),
            *((0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4)),
            *((0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B)),
            *((0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF)),
            *((0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A)),
            *((0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2)),
            *((0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943)),
        )
    )
    + "+"
)
# AFMoE: CJK ideographs (with compatibility ones), kana, Thai, Lao, Khmer, Myanmar, Hangul.
_AFMOE_ASIAN = (
    _char_class(
        (
            *((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0xF900, 0xFAFF), (0x3040, 0x309F)),
            *((0x30A0, 0x30FF), (0xFF65, 0xFF9F), (0x2F00, 0x2FDF), (0x0E00, 0x0E7F)),
            *((0x0E80, 0x0EFF), (0x1780, 0x17FF), (0x1000, 0x109F), (0xAA60, 0xAA7F)),
            *((0xA9E0, 0xA9FF), (0xAC00, 0xD7AF), (0x1100, 0x11FF)),
        )
    )
    + "+"
)
# BLOOM: anything up to whitespace or sentence punctuation, with one optional leading space.
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True, slots=True)
class PreTokenizerRule:
    """How llama.cpp pre-tokenizes one family of vocabularies."""

    splits: tuple[str, ...]  # regexes applied in turn, each isolating its matches
    ignore_merges: bool = False  # a piece that is a whole vocabulary token is emitted as is
    add_bos: bool | None = None  # llama.cpp's default when the file has no add_bos_token key
    byte_level: bool = True  # False: tokens are raw UTF-8, not GPT-2's byte alphabet
    escape_spaces: bool = False  # spaces become "▁" before splitting (SentencePiece-style BPE)


_GPT2_RULE = PreTokenizerRule((_GPT2,))
_LLAMA3_RULE = PreTokenizerRule((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_RULE = PreTokenizerRule((_QWEN2,))
_DIGITS_THEN_GPT2 = PreTokenizerRule((r"\p{N}", _GPT2))
_GPT4O_RULE = PreTokenizerRule((_GPT4O,))
_DEEPSEEK3_RULE = PreTokenizerRule((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS))
_BLOOM_RULE = PreTokenizerRule((_BLOOM,))
_TINY_AYA_RULE = PreTokenizerRule((_DIGITS_RIGHT_THREES, _GPT4O))
_BAILING_RULE = PreTokenizerRule(
    (
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    )
)
_SPM_STYLE_RULE = PreTokenizerRule((r"[^\n]+|[\n]+",), byte_level=False, escape_spaces=True)

PRE_TOKENIZER_RULES: dict[str, PreTokenizerRule] = {
    # llama.cpp's fallback for a vocabulary it does not recognize: punctuation runs, GPT-2,
    # digit runs, then runs of three ASCII digits.
    "default": PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **dict.fromkeys(
        (
            "gpt-2",
            "gpt2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ),
        _GPT2_RULE,
    ),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _LLAMA3_RULE,
    ),
    "dbrx": PreTokenizerRule((_LLAMA3,)),
    "smaug-bpe": PreTokenizerRule((_LLAMA3,)),
    # GLM-4: Llama 3's split; the vocabulary has no BOS.
    "glm4": PreTokenizerRule((_LLAMA3,), add_bos=False),
    "chatglm-bpe": PreTokenizerRule((_LLAMA3,), add_bos=False),
    "jais-2": PreTokenizerRule(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
            r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
        )
    ),
    "deepseek-llm": PreTokenizerRule(
        (
            r"[\r\n]",
            _DEEPSEEK_LLM_LETTERS,
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            _CJK_HANGUL,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizerRule(
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
    ),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3_RULE),
    "spark2_5": PreTokenizerRule(
        (
            r"\p{N}{1,3}",
            _CJK_KANA,
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        )
    ),
    "youtu": PreTokenizerRule(
        (
            r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
            rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
    # Falcon: punctuation runs (with $+<=>^~|`), GPT-2, then runs of three ASCII digits.
    "falcon": PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    # StarCoder and the vocabularies trained like it: every digit alone, then GPT-2.
    **dict.fromkeys(
        (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        _DIGITS_THEN_GPT2,
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"),
        _QWEN2_RULE,
    ),
    "solar-open": _QWEN2_RULE,
    "grok-2": _QWEN2_RULE,
    "qwen35": PreTokenizerRule((_QWEN35,)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), _BLOOM_RULE),
    "viking": PreTokenizerRule((_BLOOM, r"\p{N}")),
    "tekken": PreTokenizerRule((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": PreTokenizerRule(
        (
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2,
        ),
        add_bos=True,
    ),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_RULE),
    "granite-embed-multi-97m": PreTokenizerRule((_GRANITE_EMB,), ignore_merges=True),
    **dict.fromkeys(("tiny_aya", "cohere2moe"), _TINY_AYA_RULE),
    "kimi-k2": PreTokenizerRule((_KIMI_K2,)),
    # SuperBPE: digit runs, then a cut before every group of three digits counted from the right.
    "superbpe": PreTokenizerRule((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), _BAILING_RULE),
    "seed-coder": PreTokenizerRule(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    # Qwen2's rule without the English contractions (Turkish suffixes after an apostrophe).
    "ufakzeka": PreTokenizerRule(
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "afmoe": PreTokenizerRule(
        (
            _NUMBERS_RIGHT_THREES,
            _AFMOE_ASIAN,
            _DEEPSEEK3_WORDS,
        )
    ),
    "laguna": PreTokenizerRule((r"[^\n]+|[\n]+", _QWEN2)),
    "exaone-moe": PreTokenizerRule(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "minicpm5": PreTokenizerRule(
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
    # Raw UTF-8 vocabularies (no byte alphabet).
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m", "sarvam-moe"), _SPM_STYLE_RULE),
    "whitespace": PreTokenizerRule((r"\S+",), byte_level=False),
}


def pre_tokenizer_rule(pre: str, where: str = "tokenizer.ggml.pre") -> PreTokenizerRule:
    """The rule llama.cpp applies for `pre`; a clear error naming every accepted name otherwise."""
    rule = PRE_TOKENIZER_RULES.get(pre)
    if rule is None:
        raise ValueError(
            f"{where} is {pre!r}, a pre-tokenizer tidal does not know; supported: "
            f"{', '.join(sorted(PRE_TOKENIZER_RULES))}"
        )
    return rule


def split_pre_tokenizer(rule: PreTokenizerRule) -> pre_tokenizers.PreTokenizer:
    """The rule's regex splits alone, on raw text (what the tests compare piece by piece)."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.splits]
    return splits[0] if len(splits) == 1 else pre_tokenizers.Sequence(splits)


def build_pre_tokenizer(rule: PreTokenizerRule) -> pre_tokenizers.PreTokenizer:
    """The splits followed, for byte-level vocabularies, by the bytes-to-alphabet mapping."""
    splits = split_pre_tokenizer(rule)
    if not rule.byte_level:
        return splits
    return pre_tokenizers.Sequence(
        [splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def build_normalizer(rule: PreTokenizerRule) -> normalizers.Normalizer | None:
    return normalizers.Replace(" ", "\u2581") if rule.escape_spaces else None
