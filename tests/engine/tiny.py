"""A tiny model directory with a real tokenizer, for engine and server tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.models.tiny_hf import make_tiny_model

TINY_VOCAB = 320
_CORPUS = [
    "The tide comes in and the tide goes out.",
    "A serving engine batches requests of many users at once.",
    "def add(a, b):\n    return a + b\n",
    "Hello world! How are you today? 1234567890",
] * 20


def write_tiny_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE trained on a few sentences, with <pad>=0, <bos>=1, <eos>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "add_bos_token": True,
            }
        )
    )


def make_tiny_model_dir(out_dir: Path, family: str = "gemma3", seed: int = 0) -> Path:
    """A tiny random `family` model (HF safetensors) plus tokenizer in out_dir."""
    make_tiny_model(family, out_dir, seed=seed, vocab_size=TINY_VOCAB)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg_path.write_text(json.dumps(cfg))
    gen_path = out_dir / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        gen.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        gen_path.write_text(json.dumps(gen))
    write_tiny_tokenizer(out_dir)
    return out_dir
