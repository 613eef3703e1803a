"""Builds a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata, with an on-disk cache."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from tidal.loader.cache_files import byte_alphabet, cache_candidates, write_cache_file
from tidal.loader.gguf_file import GGUFFile
from tidal.loader.tokenizer_pre import (
    PreTokenizerRule,
    build_normalizer,
    build_pre_tokenizer,
    pre_tokenizer_rule,
)

# Bump when the built tokenizer or the cached fields change, so old caches are rebuilt.
CACHE_FORMAT_VERSION = 3
CACHE_SUFFIX = ".tokenizer.json"
_NAMED_TEMPLATE_PREFIX = "tokenizer.chat_template."

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)


@dataclass(frozen=True, slots=True)
class GGUFTokenizerInfo:
    """What the runtime needs from a GGUF's tokenizer metadata besides the tokenizer itself."""

    architecture: str
    tokenizer_model: str  # tokenizer.ggml.model: "llama" or "gpt2"
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    unk_token_id: int | None = None
    # Named variants (`tokenizer.chat_template.<name>`, e.g. "tool_use"), name -> template.
    named_chat_templates: dict[str, str] = field(default_factory=dict)


def build_gguf_tokenizer(gguf: GGUFFile) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    """Build the tokenizer a GGUF file describes (no cache)."""
    meta = gguf.metadata
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{gguf.path}: metadata tokenizer.ggml.tokens is missing or empty")
    types = _int_array(meta.get("tokenizer.ggml.token_type"), len(tokens), TOKEN_NORMAL)
    arch = str(meta.get("general.architecture", ""))
    default_add_bos = (
        model == "llama"
    )  # llama.cpp adds BOS to SentencePiece vocabs unless told not to
    if model == "llama":
        tok, vocab = _build_sentencepiece(meta, tokens, arch)
    elif model == "gpt2":
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        rule = pre_tokenizer_rule(pre, f"{gguf.path}: tokenizer.ggml.pre")
        tok, vocab = _build_bpe(meta, tokens, types, gguf.path, rule)
        if rule.add_bos is not None:
            default_add_bos = rule.add_bos
    else:
        raise ValueError(
            f"{gguf.path}: tokenizer.ggml.model is {model!r}; supported: 'llama' (SentencePiece BPE), "
            "'gpt2' (byte-level BPE)"
        )
    _add_special_tokens(tok, vocab, tokens, types)
    info = GGUFTokenizerInfo(
        architecture=arch,
        tokenizer_model=str(model),
        bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        pad_token_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        chat_template=meta.get("tokenizer.chat_template"),
        unk_token_id=_opt_int(meta.get("tokenizer.ggml.unknown_token_id")),
        named_chat_templates={
            key.removeprefix(_NAMED_TEMPLATE_PREFIX): value
            for key, value in meta.items()
            if key.startswith(_NAMED_TEMPLATE_PREFIX) and isinstance(value, str)
        },
    )
    return tok, info


def load_gguf_tokenizer(
    path: str | os.PathLike[str], gguf: GGUFFile | None = None
) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    """The GGUF's tokenizer, from the cache when it matches this exact file, else built and cached.

    The cache lives beside the model (`<model file>.tokenizer.json`), or under tidal's cache
    directory when that folder is not writable. It records the model's size and mtime and the
    format version; any mismatch means a rebuild, so a different file never reuses it.
    """
    model_path = Path(path)
    key = _source_key(model_path)
    for cache_path in cache_candidates(model_path, CACHE_SUFFIX):
        cached = _read_cache(cache_path, key)
        if cached is not None:
            return cached
    if gguf is None:
        with GGUFFile(model_path) as opened:
            tok, info = build_gguf_tokenizer(opened)
    else:
        tok, info = build_gguf_tokenizer(gguf)
    for cache_path in cache_candidates(model_path, CACHE_SUFFIX):
        if _write_cache(cache_path, key, tok, info):
            break
    return tok, info


# ---------------------------------------------------------------- SentencePiece (BPE) vocabularies


def _build_sentencepiece(
    meta: dict[str, Any], tokens: list[str], arch: str
) -> tuple[Tokenizer, dict[str, int]]:
    # A token made only of spaces is stored with real spaces in some files (Gemma) but must be
    # spelled with "▁" to be reachable, since spaces become "▁" before the model sees the text.
    spelled = [t.replace(" ", "\u2581") if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = _merges_from_vocab(spelled, vocab, sentencepiece_scores(meta, len(tokens), arch))
    unk_id = _opt_int(meta.get("tokenizer.ggml.unknown_token_id"))
    unk = spelled[unk_id] if unk_id is not None and 0 <= unk_id < len(spelled) else None
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if add_prefix:
        # "first": only the very start of the input gets the "▁", not text after a special token.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    return tok, vocab


def sentencepiece_scores(meta: dict[str, Any], num_tokens: int, arch: str) -> np.ndarray:
    """Each token's merge score: a pair whose result scores higher merges first."""
    scores = meta.get("tokenizer.ggml.scores")
    if arch.startswith("gemma") or scores is None:
        # Gemma's scores do not follow its merge order; the position in the file does.
        return -np.arange(num_tokens, dtype=np.float64)
    return np.asarray(scores, dtype=np.float64)


def _merges_from_vocab(
    tokens: list[str], vocab: dict[str, int], rank_scores: np.ndarray
) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary pieces, best merge first.

    A SentencePiece BPE model merges the adjacent pair whose result scores highest; listing the
    splits by their result's score (then longer left piece, then piece ids) gives the same order
    to a rank-based BPE.
    """
    keyed: list[tuple[float, int, int, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if vocab.get(token) != index:  # a duplicate spelling: the last one owns the string
            continue
        score = float(rank_scores[index])
        for cut in range(1, len(token)):
            left_id = vocab.get(token[:cut])
            if left_id is None:
                continue
            right_id = vocab.get(token[cut:])
            if right_id is None:
                continue
            keyed.append((-score, -cut, index, left_id, right_id, token[:cut], token[cut:]))
    keyed.sort(key=lambda k: k[:5])
    return [(k[5], k[6]) for k in keyed]


# ---------------------------------------------------------------- byte-level BPE vocabularies


def _build_bpe(
    meta: dict[str, Any], tokens: list[str], types: np.ndarray, path: Path, rule: PreTokenizerRule
) -> tuple[Tokenizer, dict[str, int]]:
    """A `tokenizer.ggml.model == "gpt2"` vocabulary: BPE over the pieces `rule` splits text into."""
    if rule.byte_level:
        table = byte_alphabet()
        alphabet = set(table.values())
        spelled = []
        for token, token_type in zip(tokens, types, strict=True):
            if token_type == TOKEN_CONTROL or set(token) <= alphabet:
                spelled.append(token)
            else:
                # A normal token written in plain UTF-8 instead of the byte alphabet: respell it.
                raw = token.encode("utf-8", errors="surrogateescape")
                spelled.append("".join(table[b] for b in raw))
    else:
        spelled = list(tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    raw_merges = meta.get("tokenizer.ggml.merges")
    if raw_merges is not None:
        merges = []
        for line in raw_merges:
            left, sep, right = line.partition(" ")
            if not sep:
                raise ValueError(
                    f"{path}: tokenizer.ggml.merges entry {line!r} is not 'left right'"
                )
            merges.append((left, right))
    else:
        scores = meta.get("tokenizer.ggml.scores")
        ranks = (
            np.asarray(scores, np.float64)
            if scores is not None
            else -np.arange(len(spelled), dtype=np.float64)
        )
        merges = _merges_from_vocab(spelled, vocab, ranks)
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            ignore_merges=rule.ignore_merges,
            byte_fallback=not rule.byte_level,
        )
    )
    normalizer = build_normalizer(rule)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = build_pre_tokenizer(rule)
    if rule.byte_level:
        tok.decoder = decoders.ByteLevel()
    else:
        steps = [decoders.Replace("\u2581", " ")] if rule.escape_spaces else []
        tok.decoder = decoders.Sequence([*steps, decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


# ---------------------------------------------------------------- shared


def _add_special_tokens(
    tok: Tokenizer, vocab: dict[str, int], tokens: list[str], types: np.ndarray
) -> None:
    """Make control tokens special and user-defined ones plain added tokens.

    Both are matched whole in raw text (llama.cpp does the same), so "<start_of_turn>" written in a
    prompt is one id. Only control tokens are special, i.e. dropped by skip_special_tokens; user-
    defined ones such as "\\n\\n" or "<b>" are ordinary text.
    """
    control = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_CONTROL and t in vocab]
    user = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _int_array(values: Any, count: int, default: int) -> np.ndarray:
    if values is None:
        return np.full(count, default, dtype=np.int64)
    arr = np.asarray(values, dtype=np.int64)
    if arr.shape != (count,):
        raise ValueError(
            f"tokenizer.ggml.token_type has {arr.size} entries; expected {count} (one per token)"
        )
    return arr


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, slots=True)
class _SourceKey:
    """Identifies the model file a cache was built from."""

    format_version: int
    size_bytes: int
    mtime_ns: int


def _source_key(model_path: Path) -> _SourceKey:
    st = model_path.stat()
    return _SourceKey(CACHE_FORMAT_VERSION, st.st_size, st.st_mtime_ns)


def _read_cache(cache_path: Path, key: _SourceKey) -> tuple[Tokenizer, GGUFTokenizerInfo] | None:
    try:
        doc = json.loads(cache_path.read_text(encoding="utf-8"))
        if doc.get("source") != asdict(key):
            return None
        return Tokenizer.from_str(doc["tokenizer"]), GGUFTokenizerInfo(**doc["info"])
    except Exception:  # a missing, stale or corrupt cache is only a miss
        return None


def _write_cache(
    cache_path: Path, key: _SourceKey, tok: Tokenizer, info: GGUFTokenizerInfo
) -> bool:
    doc = {"source": asdict(key), "info": asdict(info), "tokenizer": tok.to_str()}
    return write_cache_file(cache_path, [json.dumps(doc, ensure_ascii=False).encode("utf-8")])
