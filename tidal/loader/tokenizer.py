"""The checkpoint's tokenizer (HF directory or GGUF file) with its special ids and chat template."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from tidal.loader.chat_template import (
    ChatTemplating,
    builtin_chat_template,
    select_chat_template,
)
from tidal.loader.heap import release_free_heap
from tidal.loader.tokenizer_gguf import load_gguf_tokenizer

# Tokens that end an assistant turn, per chat family, besides the checkpoint's EOS.
END_OF_TURN_TOKENS: dict[str, tuple[str, ...]] = {
    "gemma": ("<end_of_turn>",),
    "chatml": ("<|im_end|>", "<|endoftext|>"),
    "llama3": ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    "mistral": (),
    "deepseek_r1": ("<｜end▁of▁sentence｜>",),
}
_FAMILY_ALIASES: dict[str, str] = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
    "chatml": "chatml",
    "qwen": "chatml",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "qwen3_moe": "chatml",
    "llama3": "llama3",
    "mistral": "mistral",
    "mixtral": "mistral",
    "deepseek_r1": "deepseek_r1",
}

# Model families whose checkpoints use several chat formats: the vocabulary tells which (DeepSeek
# V2/V3 checkpoints are R1 when they carry its think tags; V2 and V3 chat have no built-in).
_VOCAB_DECIDES = frozenset({"llama", "deepseek_v2", "deepseek_v3"})


class Tokenizer(ChatTemplating):
    """A fast `tokenizers.Tokenizer` plus what serving needs from the checkpoint around it."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None,
        add_bos_token: bool,
        unk_token_id: int | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
        family: str | None = None,
    ) -> None:
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.family = family
        # NOTE: ids run to the largest one: with two ids spelling one token (some GGUF
        # vocabularies), the vocabulary map that get_vocab_size counts holds fewer entries.
        self.vocab_size = max(
            hf.get_vocab_size(with_added_tokens=True),
            max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1,
        )
        end_of_turn = [hf.token_to_id(t) for t in END_OF_TURN_TOKENS.get(family or "", ())]
        self.eos_token_ids = frozenset(
            i
            for i in (eos_token_id, *extra_eos_token_ids, *end_of_turn)
            if i is not None and 0 <= i < self.vocab_size
        )
        special = {i for i, tok in hf.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (bos_token_id, eos_token_id, pad_token_id) if i is not None)
        self.all_special_ids = frozenset(special)
        self.chat_template = chat_template
        self.named_chat_templates = dict(named_chat_templates or {})

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; with add_special_tokens, BOS first when the checkpoint asks for it.

        Special tokens written in the text ("<start_of_turn>") always map to their single id.
        NOTE: a rendered chat template usually starts with BOS already: encode it with
        add_special_tokens=False.
        """
        # BOS is added here rather than by a post-processor so the rule is the checkpoint's
        # add_bos_token flag whatever the tokenizer.json's post-processor says.
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            return [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            token = self.hf.id_to_token(int(i))
            if token is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(token)
        return out

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.hf.id_to_token(token_id)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, family={self.family!r}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)}, add_bos={self.add_bos_token})"
        )


def load_tokenizer(path: str | os.PathLike[str], family: str | None = None) -> Tokenizer:
    """Load the tokenizer of a checkpoint: a `.gguf` file or a HF directory with tokenizer.json.

    `family` ("gemma", "chatml", "llama3", "mistral", "deepseek_r1", or a model type such as
    "qwen2") picks the end-of-turn tokens and the built-in chat template; by default it is guessed
    from the checkpoint.
    """
    p = Path(path)
    if p.is_dir() or p.is_file():
        tok = _load_hf_dir(p, family) if p.is_dir() else _load_gguf(p, family)
        release_free_heap()  # the vocabulary's JSON parse leaves ~3x the tokenizer's size freed
        return tok
    raise ValueError(
        f"tokenizer path {str(p)!r} is neither a GGUF file nor a directory with tokenizer.json"
    )


def _load_gguf(path: Path, family: str | None) -> Tokenizer:
    hf, info = load_gguf_tokenizer(path)
    fam = _resolve_family(family, info.architecture, hf)
    template = info.chat_template or (builtin_chat_template(fam) if fam else None)
    return Tokenizer(
        hf,
        bos_token_id=info.bos_token_id,
        eos_token_id=info.eos_token_id,
        pad_token_id=info.pad_token_id,
        add_bos_token=info.add_bos_token,
        unk_token_id=info.unk_token_id,
        chat_template=template,
        named_chat_templates=info.named_chat_templates,
        family=fam,
    )


def _load_hf_dir(root: Path, family: str | None) -> Tokenizer:
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{root}: no tokenizer.json (only fast tokenizers are supported)")
    hf = tokenizers.Tokenizer.from_file(str(tok_file))
    tcfg = _read_json(root / "tokenizer_config.json")
    gen = _read_json(root / "generation_config.json")
    cfg = _read_json(root / "config.json")

    def token_id(field: str) -> int | None:
        value = tcfg.get(field)
        if isinstance(value, dict):  # older configs store an AddedToken dict
            value = value.get("content")
        if value is None:
            return None
        found = hf.token_to_id(str(value))
        if found is None:
            raise ValueError(
                f"{root}: tokenizer_config.json {field} is {value!r}, which is not in the vocabulary"
            )
        return found

    bos = token_id("bos_token")
    eos = token_id("eos_token")
    pad = token_id("pad_token")
    bos = bos if bos is not None else _first_id(gen.get("bos_token_id", cfg.get("bos_token_id")))
    gen_eos = _id_list(gen.get("eos_token_id", cfg.get("eos_token_id")))
    eos = eos if eos is not None else (gen_eos[0] if gen_eos else None)
    pad = pad if pad is not None else _first_id(gen.get("pad_token_id", cfg.get("pad_token_id")))
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:
        # No flag: follow the tokenizer.json's post-processor (Llama 3 adds BOS there, Qwen does not).
        probe = hf.encode("", add_special_tokens=True).ids
        add_bos = bos is not None and probe[:1] == [bos]
    template = _hf_chat_template(root, tcfg)
    fam = _resolve_family(family, str(cfg.get("model_type", "")), hf)
    if template is None and fam is not None:
        template = builtin_chat_template(fam)
    return Tokenizer(
        hf,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        add_bos_token=bool(add_bos),
        unk_token_id=_unk_id(hf, tcfg.get("unk_token")),
        extra_eos_token_ids=gen_eos,
        chat_template=template,
        family=fam,
    )


def _hf_chat_template(root: Path, tcfg: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = root / "chat_template.json"
    if json_file.is_file():
        return select_chat_template(_read_json(json_file).get("chat_template"))
    return select_chat_template(tcfg.get("chat_template"))


def _resolve_family(family: str | None, model_type: str, hf: tokenizers.Tokenizer) -> str | None:
    if family is not None and family.lower() not in {*_FAMILY_ALIASES, *_VOCAB_DECIDES}:
        accepted = sorted({*_FAMILY_ALIASES, *_VOCAB_DECIDES})
        raise ValueError(f"family is {family!r}; accepted: {accepted}")
    # DeepSeek R1 and its distills (Qwen2 or Llama architectures) keep DeepSeek's chat tokens and
    # think tags whatever the architecture: the vocabulary decides before a model type does (only
    # a chat family named outright wins over it).
    if family is None or family.lower() not in END_OF_TURN_TOKENS:
        if hf.token_to_id("<｜Assistant｜>") is not None and hf.token_to_id("</think>") is not None:
            return "deepseek_r1"
    if family is not None and family.lower() not in _VOCAB_DECIDES:
        return _FAMILY_ALIASES[family.lower()]
    resolved = _FAMILY_ALIASES.get(model_type.lower())
    if resolved is not None:
        return resolved
    # Llama-architecture checkpoints cover several chat formats: tell them apart by their vocabulary.
    if hf.token_to_id("<|eot_id|>") is not None:
        return "llama3"
    if hf.token_to_id("<|im_end|>") is not None:
        return "chatml"
    if hf.token_to_id("<start_of_turn>") is not None:
        return "gemma"
    if hf.token_to_id("[INST]") is not None:
        return "mistral"
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id is {value!r}; expected an int or a list of ints")


def _first_id(value: Any) -> int | None:
    ids = _id_list(value)
    return ids[0] if ids else None


def _unk_id(hf: tokenizers.Tokenizer, value: Any) -> int | None:
    if isinstance(value, dict):  # older configs store an AddedToken dict
        value = value.get("content")
    return None if value is None else hf.token_to_id(str(value))
