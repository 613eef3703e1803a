"""An encoding tokenizer in a few MB for SentencePiece-BPE GGUF vocabularies, for the API process.

The API process of `tidal serve` encodes prompts, renders chat templates and decodes logprob
tokens. A `tokenizers.Tokenizer` built from Gemma 3's 262k-token GGUF vocabulary holds ~95 MB
for it (two vocabulary maps, ~515k merges, the added tokens' automaton): about a sixth of an idle
server. `CompactTokenizer` is a `TokenDecoder` (every token's string as one UTF-8 blob with
offsets) that also encodes, in C (tidal/kernels/spm_bpe.c): the merges that tidal derives from
such a vocabulary are "every split of a token into two vocabulary pieces, ranked by the token's
score", so two adjacent symbols merge when their concatenation is a token, and a hash table of
token ids with one rank per token replaces the merge map (~8 MB in all for Gemma 3).

It covers the vocabularies tidal.loader.tokenizer_gguf builds as SentencePiece BPE with spaces
replaced by U+2581 and no pre-tokenizer (Gemma's); `compact_encoding_tokenizer` checks it
against the full tokenizer on several thousand texts (every added token, byte-fallback
characters, chat turns, random token windows decoded to text, long runs) and keeps the full
tokenizer on any difference, or where no C compiler exists. `load_compact_tokenizer` caches the
checked result on disk, so a server's later starts read ~9 MB and import neither numpy nor
`tokenizers`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import random
import sys
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tidal.loader.chat_template import ChatTemplating
from tidal.loader.compact_cache import load_cached_compact
from tidal.loader.token_decoder import TokenDecoder, compact_tokenizer

# Bump when the file layout or what encode does changes, so old files are rebuilt (the C
# source's digest is part of the key as well).
CACHE_FORMAT_VERSION = 1
_KERNEL = Path(__file__).resolve().parent.parent / "kernels" / "spm_bpe.c"
# The normalizer this encoder implements (tokenizer_gguf's SentencePiece vocabularies without
# a space prefix, Gemma's).
_SPACE_TO_METASPACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
# Texts the self-check encodes: random token windows decoded to text, random character strings.
_CHECK_WINDOWS = 3_000
_CHECK_STRINGS = 2_000

_word = ctypes.c_void_p


class UnsupportedEncoder(ValueError):
    """The tokenizer is not one CompactTokenizer can encode as (or no C compiler exists)."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    from tidal.kernels.build import load

    lib = load("spm_bpe")
    if lib is None:
        return None
    lib.tidal_spm_new.restype = _word
    lib.tidal_spm_new.argtypes = [_word, _word, _word, ctypes.c_int32, ctypes.c_int32, _word,
                                  ctypes.c_int32]  # fmt: skip
    lib.tidal_spm_free.restype = None
    lib.tidal_spm_free.argtypes = [_word]
    lib.tidal_spm_encode.restype = ctypes.c_int64
    lib.tidal_spm_encode.argtypes = [_word, ctypes.c_char_p, ctypes.c_int64, _word]
    lib.tidal_spm_token_id.restype = ctypes.c_int32
    lib.tidal_spm_token_id.argtypes = [_word, ctypes.c_char_p, ctypes.c_int64]
    return lib


def _kernel_digest() -> str:
    return hashlib.sha256(_KERNEL.read_bytes()).hexdigest()[:16]


class CompactTokenizer(TokenDecoder, ChatTemplating):
    """What the API process reads from a `Tokenizer` (encode, decode, token strings and ids, the
    chat templates, the special ids), over the decoder's blob plus per-token merge ranks.

    `load_full()` (or `.hf`) loads the full tokenizer for the rare caller that needs it.
    """

    CACHE_SUFFIX = ".compact-tokenizer"

    @classmethod
    def cache_format(cls) -> str:
        # A changed encoding kernel is checked against the full tokenizer again.
        return f"{CACHE_FORMAT_VERSION}-{_kernel_digest()}"

    def __init__(
        self,
        decoder: TokenDecoder,
        ranks: array,
        added: array,
        unk_id: int | None,
        chat_template: str | None,
        named_chat_templates: dict[str, str],
    ) -> None:
        super().__init__(
            decoder._blob,
            decoder._offsets,
            decoder._skip,
            decoder._missing,
            decoder.decoder_config,
            decoder.attrs,
            decoder._load_full,
        )
        lib = _library()
        if lib is None:
            raise UnsupportedEncoder("the spm_bpe kernel is not available (no C compiler?)")
        if len(ranks) != len(self._offsets) - 1:
            raise UnsupportedEncoder(f"{len(ranks)} ranks for {len(self._offsets) - 1} tokens")
        self._lib = lib
        self._ranks = ranks
        self._added = added
        self._unk = unk_id
        self.chat_template = chat_template
        self.named_chat_templates = dict(named_chat_templates)
        # The C side reads the blob, offsets and ranks in place: this object keeps them alive.
        handle = lib.tidal_spm_new(
            self._blob,
            self._offsets.buffer_info()[0],
            ranks.buffer_info()[0],
            len(ranks),
            -1 if unk_id is None else unk_id,
            added.buffer_info()[0],
            len(added),
        )
        if not handle:
            raise MemoryError("tidal_spm_new: out of memory")
        self._handle = handle

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.tidal_spm_free(handle)
            self._handle = None

    # ---- the Tokenizer surface the API process uses ----------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As tidal.loader.tokenizer.Tokenizer.encode: added tokens written in the text map to
        their id; with add_special_tokens, BOS first when the checkpoint asks for it."""
        ids = self._encode(text)
        if add_special_tokens and self.add_bos_token:
            return [self.bos_token_id, *ids]
        return ids

    def _encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        # Every id covers at least one byte, except a space whose U+2581 is spelled in bytes.
        out = array("i", bytes(4 * (3 * len(data) + 1)))
        n = self._lib.tidal_spm_encode(self._handle, data, len(data), out.buffer_info()[0])
        if n == -1:
            raise MemoryError("tidal_spm_encode: out of memory")
        if n < 0:
            raise ValueError("the text has a character this vocabulary cannot spell")
        del out[n:]
        return out.tolist()

    def token_to_id(self, token: str) -> int | None:
        data = token.encode("utf-8")
        found = self._lib.tidal_spm_token_id(self._handle, data, len(data))
        return None if found < 0 else found

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            token = self._token(int(i))
            if token is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(token)
        return out

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else super()._token(token_id)

    @property
    def hf(self) -> Any:
        """The full tokenizer's `tokenizers.Tokenizer` (loaded on first use)."""
        return self.load_full().hf

    # ---- the on-disk cache -------------------------------------------------------------------

    def cache_parts(self) -> tuple[dict[str, Any], list[bytes]]:
        fields, arrays = super().cache_parts()
        fields.update(
            unk_id=self._unk,
            chat_template=self.chat_template,
            named_chat_templates=self.named_chat_templates,
        )
        return fields, [*arrays, self._ranks.tobytes(), self._added.tobytes()]

    @classmethod
    def from_cache_parts(
        cls, header: dict[str, Any], parts: list[bytes], load_full: Callable[[], Any]
    ) -> CompactTokenizer:
        decoder = TokenDecoder.from_cache_parts(header, parts[:4], load_full)
        ranks, added = array("i"), array("i")
        ranks.frombytes(parts[4])
        added.frombytes(parts[5])
        return cls(
            decoder,
            ranks,
            added,
            header["unk_id"],
            header["chat_template"],
            header["named_chat_templates"],
        )

    def __repr__(self) -> str:
        return (
            f"CompactTokenizer(vocab_size={self.vocab_size}, family={self.family!r}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )

    @property
    def nbytes(self) -> int:
        """The arrays Python holds (the C side adds a hash table of 8 bytes a token or so)."""
        return super().nbytes + 4 * (len(self._ranks) + len(self._added))


# ---------------------------------------------------------------- building and checking


def _merge_ranks(path: Path, num_tokens: int) -> array:
    """Each token's rank by the score tidal's SentencePiece merges use (equal scores share one)."""
    import numpy as np

    from tidal.loader.gguf_file import GGUFFile
    from tidal.loader.tokenizer_gguf import sentencepiece_scores

    with GGUFFile(path) as gguf:
        meta = gguf.metadata
        if meta.get("tokenizer.ggml.model") != "llama":
            raise UnsupportedEncoder(
                "not a SentencePiece (tokenizer.ggml.model 'llama') vocabulary"
            )
        tokens = meta.get("tokenizer.ggml.tokens") or []
        if len(tokens) != num_tokens:
            raise UnsupportedEncoder(f"{len(tokens)} GGUF tokens for {num_tokens} tokenizer ids")
        if len(set(tokens)) != len(tokens):  # spm_bpe.c would pick its own id for the piece
            raise UnsupportedEncoder("two ids spell one token")
        scores = sentencepiece_scores(meta, num_tokens, str(meta.get("general.architecture", "")))
    # Higher score merges first: rank 0 is the highest score.
    _, dense = np.unique(-scores, return_inverse=True)
    return array("i", dense.astype(np.int32).tobytes())


def _check_model(hf: Any) -> None:
    """UnsupportedEncoder unless `hf` is the SentencePiece BPE that spm_bpe.c implements."""
    model = hf.model
    if type(model).__name__ != "BPE":
        raise UnsupportedEncoder(f"the model is {type(model).__name__}, not BPE")
    if (
        model.dropout is not None
        or not model.byte_fallback
        or not model.fuse_unk
        or model.continuing_subword_prefix
        or model.end_of_word_suffix
        or getattr(model, "ignore_merges", False)
    ):
        raise UnsupportedEncoder(
            "BPE options other than SentencePiece's (byte fallback, fused unk)"
        )
    if hf.pre_tokenizer is not None:
        raise UnsupportedEncoder("the tokenizer has a pre-tokenizer")
    normalizer = None if hf.normalizer is None else json.loads(hf.normalizer.__getstate__())
    if normalizer != _SPACE_TO_METASPACE:
        raise UnsupportedEncoder(f"the normalizer is {normalizer}, not spaces to U+2581")
    if any(t.normalized or t.lstrip or t.rstrip or t.single_word
           for t in hf.get_added_tokens_decoder().values()):  # fmt: skip
        raise UnsupportedEncoder("an added token is normalized or strips or matches single words")


def check_encoder(tok: Any, full: Any, seed: int = 0) -> str | None:
    """The first text `tok` encodes unlike the full tokenizer `full`, or None if none."""
    hf = full.hf
    rng = random.Random(seed)
    size = tok.vocab_size
    added = sorted(hf.get_added_tokens_decoder())
    texts = [
        "", " ", "  ", "   x", "x   ", "hello world", "Hello, World!", "a\tb\t\tc", "\n", "\n\n",
        "line one\nline two\n\n\nline three", "<start_of_turn>user\nHi<end_of_turn>\n",
        "<0x0A>", "<unk>", "<b>bold</b>", "caf\u00e9 na\u00efve \u00fcber", "\u65e5\u672c\u8a9e",
        "\U0001f600\U0001f680", "\u2581", "\u2581\u2581 x", "12345678901234567890", "!!!???...",
        "\U0010fffd\u0378\u0000\u00ad", "e\u0301",
    ]  # fmt: skip
    texts += [tok._token(i) or "" for i in added]
    texts += [f"x{tok._token(i)}y {tok._token(i)}" for i in added[:200]]
    if tok.chat_template:
        messages = [
            {"role": "user", "content": "What is the tide?"},
            {"role": "assistant", "content": "The sea's rise and fall."},
            {"role": "user", "content": "  Twice a day?\n\n"},
        ]
        texts.append(tok.apply_chat_template(messages))
    # Decoded windows of random ids: text the vocabulary spells, with added tokens and bytes.
    pool = added + [i for i in range(min(size, 512)) if (tok._token(i) or "").startswith("<0x")]
    for _ in range(_CHECK_WINDOWS):
        ids = [
            rng.choice(pool) if rng.random() < 0.1 else rng.randrange(size)
            for _ in range(rng.randint(1, 24))
        ]
        texts.append(tok.decode(ids, skip_special_tokens=rng.random() < 0.5))
    chars = (
        " \n\t" + "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789.,;:!?'\"()<>/-_=+*&^%$#@"
        "\u00e9\u00f1\u00df\u4e2d\u6587\u0414\u0430\u05d0\u0627\u2581\U0001f30a\u200b\u0301"
    )
    for _ in range(_CHECK_STRINGS):
        texts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 40))))
    words = [tok._token(rng.randrange(size)) or "" for _ in range(4000)]
    texts.append(" ".join(words).replace("\u2581", " "))  # one long run (~30k characters)
    expected = hf.encode_batch(texts, add_special_tokens=False)
    for text, want in zip(texts, expected, strict=True):
        if tok._encode(text) != want.ids:
            return text
    return None


def compact_encoding_tokenizer(
    full: Any, path: Path, load_full: Callable[[], Any]
) -> CompactTokenizer | str:
    """A checked CompactTokenizer for the full tokenizer `full`, or why the full one must stay."""
    if not path.is_file():
        return "not a GGUF file"
    try:
        hf = full.hf
        _check_model(hf)
        decoder = compact_tokenizer(full, load_full)  # the decode half, checked
        if isinstance(decoder, str):
            return decoder
        ranks = _merge_ranks(path, decoder.vocab_size)
        unk = hf.model.unk_token
        tok = CompactTokenizer(
            decoder,
            ranks,
            array("i", sorted(hf.get_added_tokens_decoder())),
            None if unk is None else hf.token_to_id(unk),
            full.chat_template,
            full.named_chat_templates,
        )
    except UnsupportedEncoder as exc:
        return str(exc)
    bad = check_encoder(tok, full)
    if bad is not None:
        return f"the compact tokenizer encodes {bad[:80]!r} differently"
    return tok


def load_compact_tokenizer(
    path: str | os.PathLike[str], family: str | None = None, *, build_elsewhere: bool = True
) -> Any:
    """The checkpoint's tokenizer for the API process: a CompactTokenizer where it encodes and
    decodes exactly as the full tokenizer does (checked once, the result cached beside the model
    as `<model>.gguf.compact-tokenizer`), else the full tokenizer. `build_elsewhere`: that
    first build runs in a child process, so this one never holds the full tokenizer."""
    if _library() is None:  # no compiler (or TIDAL_KERNELS=0): no verdict to cache either
        from tidal.loader.tokenizer import load_tokenizer

        return load_tokenizer(path, family)
    return load_cached_compact(
        path,
        family,
        CompactTokenizer,
        compact_encoding_tokenizer,
        _BUILD_COMMAND if build_elsewhere else None,
    )


# What load_compact_tokenizer runs to build in a child process (the path and family appended).
_BUILD_COMMAND = (
    sys.executable,
    "-c",
    "import sys; from tidal.loader.token_encoder import load_compact_tokenizer; "
    "load_compact_tokenizer(sys.argv[1], sys.argv[2] or None, build_elsewhere=False)",
)
