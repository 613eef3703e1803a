"""A decode-only view of a checkpoint's tokenizer, for the process that only turns ids into text.

The engine process of `tidal serve` never encodes (the API process does), yet a full
`tokenizers.Tokenizer` for a 262k-token vocabulary holds ~95 MB there (vocabulary and merge
maps, pre-tokenizer state). `TokenDecoder` keeps what decoding reads: every token's string as one
UTF-8 blob with offsets (3.4 MB for Gemma 3's vocabulary), the added tokens that count as
special, and the decoder steps of the tokenizer's `decode_chain`, re-implemented here:
Sequence, Replace (string pattern), ByteFallback, Fuse, Strip, ByteLevel and Metaspace; no
decoder joins tokens with spaces, as `tokenizers` does. Anything else raises `UnsupportedDecoder`.

`compact_tokenizer` builds it from a loaded `Tokenizer` and checks it against the tokenizer's
own `decode` (every special and byte token, thousands of single tokens and short mixed windows,
both skip modes); on any difference the full tokenizer is kept, so text is never decoded
differently from the API process. `load_token_decoder` caches the checked result on disk
(tidal.loader.compact_cache).
"""

from __future__ import annotations

import json
import logging
import os
import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import Any

from tidal.loader.cache_files import byte_alphabet

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# Bump when the file layout or what decode does changes, so old files are rebuilt.
CACHE_FORMAT_VERSION = 3  # 3: vocabularies with duplicate spellings keep their last ids
CACHE_SUFFIX = ".token-decoder"
# Random single tokens and mixed windows the self-check decodes (plus every special/byte token).
_CHECK_SINGLE = 5_000
_CHECK_WINDOWS = 1_000
_CHECK_WINDOW_MAX = 8
# ... and the last ids alone: a table cut short loses those first.
_CHECK_LAST = 64

Step = Callable[[list[str]], list[str]]


class UnsupportedDecoder(ValueError):
    """The tokenizer's decoder has a step TokenDecoder does not implement."""


def _byte_token(token: str) -> int | None:
    """The byte a ByteFallback piece "<0xHH>" stands for, else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        if all(c in "0123456789abcdefABCDEF" for c in digits):
            return int(digits, 16)
    return None


def _replace(pattern: str, content: str) -> Step:
    return lambda tokens: [t.replace(pattern, content) for t in tokens]


def _byte_fallback(tokens: list[str]) -> list[str]:
    out: list[str] = []
    pending = bytearray()

    def flush() -> None:
        try:
            out.append(pending.decode("utf-8"))
        except UnicodeDecodeError:
            # Invalid UTF-8 becomes one replacement character per byte, as in tokenizers.
            out.extend(_REPLACEMENT for _ in pending)
        pending.clear()

    for token in tokens:
        byte = _byte_token(token)
        if byte is not None:
            pending.append(byte)
            continue
        if pending:
            flush()
        out.append(token)
    if pending:
        flush()
    return out


def _fuse(tokens: list[str]) -> list[str]:
    return ["".join(tokens)]


def _strip(content: str, start: int, stop: int) -> Step:
    def step(tokens: list[str]) -> list[str]:
        out = []
        for token in tokens:
            lo = 0
            while lo < min(start, len(token)) and token[lo] == content:
                lo += 1
            hi = len(token)
            while len(token) - hi < stop and hi > 0 and token[hi - 1] == content:
                hi -= 1
            out.append(token[lo:hi] if lo <= hi else "")
        return out

    return step


def _byte_level() -> Step:
    # GPT-2's byte alphabet, character -> byte (tokenizers' `bytes_char` inverted).
    alphabet = {c: b for b, c in byte_alphabet().items()}

    def step(tokens: list[str]) -> list[str]:
        data = bytearray()
        for token in tokens:
            try:
                data.extend(alphabet[c] for c in token)
            except KeyError:  # a character outside the byte alphabet: the token's own UTF-8
                data.extend(token.encode("utf-8"))
        return [data.decode("utf-8", "replace")]

    return step


def _metaspace(replacement: str, drop_first: bool) -> Step:
    def step(tokens: list[str]) -> list[str]:
        out = []
        for i, token in enumerate(tokens):
            out.append(token.replace(replacement, "" if i == 0 and drop_first else " "))
        return out

    return step


def decoder_steps(config: dict[str, Any] | None) -> list[Step] | None:
    """The steps of a tokenizers decoder config (its JSON); None for no decoder."""
    if config is None:
        return None
    kind = config.get("type")
    if kind == "Sequence":
        steps: list[Step] = []
        for sub in config.get("decoders", []):
            steps.extend(decoder_steps(sub) or ())
        return steps
    if kind == "Replace":
        pattern = config.get("pattern", {})
        if "String" not in pattern:
            raise UnsupportedDecoder(f"Replace decoder with pattern {pattern!r}")
        return [_replace(pattern["String"], config.get("content", ""))]
    if kind == "ByteFallback":
        return [_byte_fallback]
    if kind == "Fuse":
        return [_fuse]
    if kind == "Strip":
        content = config.get("content", " ")
        if len(content) != 1:
            raise UnsupportedDecoder(f"Strip decoder with content {content!r}")
        return [_strip(content, int(config.get("start", 0)), int(config.get("stop", 0)))]
    if kind == "ByteLevel":
        return [_byte_level()]
    if kind == "Metaspace":
        replacement = config.get("replacement", "▁")
        scheme = str(config.get("prepend_scheme", "always")).lower()
        if config.get("add_prefix_space") is False and "prepend_scheme" not in config:
            scheme = "never"
        return [_metaspace(replacement, scheme != "never")]
    raise UnsupportedDecoder(f"decoder type {kind!r}")


_ATTRS = (
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "add_bos_token", "family",
    "vocab_size",
)  # fmt: skip


def _uints(data: bytes) -> array:
    values = array("I")
    values.frombytes(data)
    return values


class TokenDecoder:
    """Ids -> text as the checkpoint's tokenizer decodes them, plus its special ids; no encoding.

    Has what the engine process reads from a `Tokenizer` (`decode`, the special and end ids,
    `family`, `vocab_size`); `load_full()` loads the full tokenizer for the rare user that needs
    one (structured output builds its grammar tokenizer from it).
    """

    CACHE_SUFFIX = CACHE_SUFFIX

    @classmethod
    def cache_format(cls) -> int | str:
        """Part of the on-disk cache's key: a change means the cached files are rebuilt."""
        return CACHE_FORMAT_VERSION

    def __init__(
        self,
        blob: bytes,
        offsets: array,
        skipped_when_special: Iterable[int],
        missing: Iterable[int],
        decoder_config: dict[str, Any] | None,
        attrs: dict[str, Any],
        load_full: Callable[[], Any],
    ) -> None:
        self._blob = blob
        self._offsets = offsets  # token i is blob[offsets[i]:offsets[i + 1]]
        self._skip = frozenset(skipped_when_special)
        self._missing = frozenset(missing)  # ids with no token: decode drops them
        self.decoder_config = decoder_config
        self._steps = decoder_steps(decoder_config)
        self.attrs = attrs
        for name in _ATTRS:
            setattr(self, name, attrs[name])
        self.eos_token_ids = frozenset(attrs["eos_token_ids"])
        self.all_special_ids = frozenset(attrs["all_special_ids"])
        self._load_full = load_full
        self._full: Any = None

    @classmethod
    def from_tokenizer(cls, tok: Any, load_full: Callable[[], Any]) -> TokenDecoder:
        """A TokenDecoder for `tok` (tidal.loader.tokenizer.Tokenizer); UnsupportedDecoder if its
        decoder has a step this module does not implement. Not checked: see compact_tokenizer."""
        hf = tok.hf
        config = None if hf.decoder is None else json.loads(hf.decoder.__getstate__())
        decoder_steps(config)  # fails fast on a step this module lacks
        tokens = [hf.id_to_token(i) for i in range(tok.vocab_size)]
        encoded = [b"" if t is None else t.encode("utf-8") for t in tokens]
        # tokenizers skips by the token's content: any id whose token is a special added token's.
        special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
        attrs = {name: getattr(tok, name) for name in _ATTRS}
        attrs["eos_token_ids"] = sorted(tok.eos_token_ids)
        attrs["all_special_ids"] = sorted(tok.all_special_ids)
        return cls(
            b"".join(encoded),
            array("I", accumulate(map(len, encoded), initial=0)),
            [i for i, t in enumerate(tokens) if t in special],
            [i for i, t in enumerate(tokens) if t is None],
            config,
            attrs,
            load_full,
        )

    def cache_parts(self) -> tuple[dict[str, Any], list[bytes]]:
        """The header fields and arrays the on-disk cache keeps (from_cache_parts reads them)."""
        skip = array("I", sorted(self._skip))
        missing = array("I", sorted(self._missing))
        fields = {"decoder": self.decoder_config, "attrs": self.attrs}
        return fields, [self._blob, self._offsets.tobytes(), skip.tobytes(), missing.tobytes()]

    @classmethod
    def from_cache_parts(
        cls, header: dict[str, Any], parts: list[bytes], load_full: Callable[[], Any]
    ) -> TokenDecoder:
        blob, offsets, skip, missing = parts[0], *(_uints(p) for p in parts[1:4])
        if offsets[-1] != len(blob):
            raise ValueError("the offsets do not end at the blob's end")
        return cls(blob, offsets, skip, missing, header["decoder"], header["attrs"], load_full)

    @property
    def nbytes(self) -> int:
        return len(self._blob) + self._offsets.itemsize * len(self._offsets)

    def _token(self, i: int) -> str | None:
        if not 0 <= i < len(self._offsets) - 1 or i in self._missing:
            return None
        return self._blob[self._offsets[i] : self._offsets[i + 1]].decode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        blob, offsets, missing = self._blob, self._offsets, self._missing
        skip = self._skip if skip_special_tokens else ()
        last = len(offsets) - 1
        tokens = []
        for i in ids:
            i = int(i)
            # Ids with no token (outside the vocabulary or unassigned) are dropped, as in tokenizers.
            if 0 <= i < last and i not in skip and i not in missing:
                tokens.append(blob[offsets[i] : offsets[i + 1]].decode("utf-8"))
        if self._steps is None:
            return " ".join(tokens)
        for step in self._steps:
            tokens = step(tokens)
        return "".join(tokens)

    def load_full(self) -> Any:
        """The full tokenizer (loaded once, on first call)."""
        if self._full is None:
            self._full = self._load_full()
        return self._full

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise TypeError("TokenDecoder only decodes; load_full() gives the encoding tokenizer")

    def __repr__(self) -> str:
        return (
            f"TokenDecoder(vocab_size={self.vocab_size}, family={self.family!r}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )


def check_token_decoder(decoder: TokenDecoder, tok: Any, seed: int = 0) -> list[int] | None:
    """The first ids `decoder` decodes unlike `tok.hf` (both skip modes), or None if none do."""
    hf = tok.hf
    size = decoder.vocab_size
    if size != tok.vocab_size:
        return [min(size, tok.vocab_size)]  # the first id only one of them has
    rng = random.Random(seed)
    specials = sorted(i for i in decoder._skip if i < size)
    offsets = decoder._offsets  # a byte piece "<0xHH>" is 6 bytes: decode only those
    byte_ids = [
        i
        for i in range(size)
        if offsets[i + 1] - offsets[i] == 6 and _byte_token(decoder._token(i) or "") is not None
    ]
    cases = [[i] for i in specials + byte_ids + list(range(max(0, size - _CHECK_LAST), size))]
    cases += [[rng.randrange(size)] for _ in range(min(_CHECK_SINGLE, size))]
    pool = specials + byte_ids
    for _ in range(_CHECK_WINDOWS):
        window = []
        for _ in range(rng.randint(2, _CHECK_WINDOW_MAX)):
            # Mostly ordinary tokens, with specials and byte runs mixed in.
            roll = rng.random()
            window.append(rng.choice(pool) if pool and roll < 0.3 else rng.randrange(size))
        cases.append(window)
    for skip in (False, True):
        expected = hf.decode_batch(cases, skip_special_tokens=skip)
        for ids, want in zip(cases, expected, strict=True):
            if decoder.decode(ids, skip) != want:
                return ids
    return None


def compact_tokenizer(tok: Any, load_full: Callable[[], Any]) -> TokenDecoder | str:
    """A checked TokenDecoder for `tok`, or the reason the full tokenizer must be kept."""
    try:
        decoder = TokenDecoder.from_tokenizer(tok, load_full)
    except UnsupportedDecoder as exc:
        return str(exc)
    bad = check_token_decoder(decoder, tok)
    if bad is not None:
        return f"the decode-only tokenizer decodes ids {bad} differently"
    return decoder


def load_token_decoder(path: str | os.PathLike[str], family: str | None = None) -> Any:
    """The checkpoint's tokenizer for a process that only decodes: a TokenDecoder when it decodes
    exactly as the full tokenizer does, else the full tokenizer.

    The first load builds the decoder from the full tokenizer, checks it against it and caches
    the result (`<model>.gguf.token-decoder`, or under tidal's cache directory); later loads read
    a few MB (3.4 for Gemma 3) instead of parsing the tokenizer's JSON, so they are faster as well as smaller.
    """
    from tidal.loader.compact_cache import load_cached_compact  # (it imports this module)

    return load_cached_compact(
        path, family, TokenDecoder, lambda tok, _path, load_full: compact_tokenizer(tok, load_full)
    )
