"""The twins' stand-in tokenizer: the donor's byte-level BPE (Qwen2's, 152,064 tokens) cut or
padded to a layout's vocabulary size, or a small byte-level one that needs no download.

Only the vocabulary's size is the model's: a Llama 3.1 twin has 128,256 tokens, but they are
Qwen2's first ones (the donor's control tokens moved to the end), so its text is not tokenized as
Llama's would be. That changes no tensor shape and no speed of a step; it changes the token
count of a given text, so speed is compared per token, never per word.
"""

from __future__ import annotations

from tidal.bench.twin_header import ARRAY, BOOL, INT32, STRING, UINT32, Header, MetaValue, meta
from tidal.loader.cache_files import byte_alphabet

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n'"
    " }}{% endif %}"
)
# the byte-level stand-in's merges: a few common English pairs (Ġ is GPT-2's space)
_BYTE_MERGES = ("Ġ t", "h e", "i n", "e r", "a n", "r e", "o n", "Ġ a", "e n", "a t", "o r",
                "Ġ s", "Ġ w", "e s", "i s", "Ġt he", "Ġ o", "Ġ c", "i t", "Ġ b")  # fmt: skip


def donor_tokenizer(donor: Header, vocab_size: int) -> list[MetaValue]:
    """The donor's tokenizer keys with its vocabulary cut or padded to `vocab_size` tokens.

    Cut: the control and user-defined tokens past the cut take the last ids, the special-token
    ids follow them, and only merges whose two pieces and result remain are kept. Padded:
    `[PAD<id>]` tokens of type UNUSED, as convert_hf_to_gguf.py pads Qwen's vocabularies."""
    keys = [m for m in donor.metadata if m.key.startswith("tokenizer.")]
    tokens = list(donor.get("tokenizer.ggml.tokens"))
    types = list(donor.get("tokenizer.ggml.token_type"))
    if vocab_size >= len(tokens):
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        types += [UNUSED] * (vocab_size - len(types))
    else:
        moved = [i for i in range(vocab_size, len(tokens)) if types[i] in (CONTROL, USER_DEFINED)
                 and not tokens[i].startswith("[PAD")]  # fmt: skip
        keep = vocab_size - len(moved)
        if keep < 256 + 64:
            raise ValueError(
                f"vocab_size={vocab_size} is too small for the donor tokenizer: it needs "
                f"{256 + 64 + len(moved)} or more (the 256 bytes, some merges, its "
                f"{len(moved)} special tokens)"
            )
        tokens = tokens[:keep] + [tokens[i] for i in moved]
        types = types[:keep] + [types[i] for i in moved]
    ids = {t: i for i, t in enumerate(tokens)}
    merges = [m for m in donor.get("tokenizer.ggml.merges") if _merge_kept(m, ids)]
    out = []
    old_tokens = donor.get("tokenizer.ggml.tokens")
    for item in keys:
        if item.key == "tokenizer.ggml.tokens":
            item = meta(item.key, tokens, ARRAY, STRING)
        elif item.key == "tokenizer.ggml.token_type":
            item = meta(item.key, types, ARRAY, INT32)
        elif item.key == "tokenizer.ggml.merges":
            item = meta(item.key, merges, ARRAY, STRING)
        elif item.key.endswith("_token_id"):
            new_id = ids.get(old_tokens[item.value()])
            if new_id is None:
                continue  # its token did not survive the cut
            item = meta(item.key, new_id, item.vtype)
        out.append(item)
    return out


def byte_tokenizer(vocab_size: int) -> list[MetaValue]:
    """A byte-level BPE of 256 byte tokens, a few merges, ChatML's three control tokens and
    `[PAD<id>]` up to `vocab_size`: a stand-in that needs no download (tests, CI)."""
    table = byte_alphabet()
    tokens = [table[b] for b in range(256)]
    for line in _BYTE_MERGES:
        tokens.append(line.replace(" ", ""))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(specials)
    tokens += specials
    if vocab_size < len(tokens):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for the byte-level tokenizer: expected "
            f">= {len(tokens)}"
        )
    types += [UNUSED] * (vocab_size - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    eos = tokens.index("<|im_end|>")
    return [
        meta("tokenizer.ggml.model", "gpt2", STRING),
        meta("tokenizer.ggml.pre", "qwen2", STRING),
        meta("tokenizer.ggml.tokens", tokens, ARRAY, STRING),
        meta("tokenizer.ggml.token_type", types, ARRAY, INT32),
        meta("tokenizer.ggml.merges", list(_BYTE_MERGES), ARRAY, STRING),
        meta("tokenizer.ggml.eos_token_id", eos, UINT32),
        meta("tokenizer.ggml.padding_token_id", tokens.index("<|endoftext|>"), UINT32),
        meta("tokenizer.ggml.add_bos_token", False, BOOL),
        meta("tokenizer.chat_template", _CHATML, STRING),
    ]


def _merge_kept(line: str, ids: dict[str, int]) -> bool:
    left, sep, right = line.partition(" ")
    return bool(sep) and left in ids and right in ids and left + right in ids
