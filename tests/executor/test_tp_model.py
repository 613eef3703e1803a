"""Tensor-parallel shards (two gloo ranks) against the whole model: float32 logits within 1e-4
through paged attention for a ragged batch, 20 identical greedy tokens; the same tokens with
int8 weights and with GGUF blocks (a GGUF whose one KV head is replicated on both ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.executor.spmd import run_ranks
from tests.loader.test_weight_cache import Q, write_tiny_quantized_gemma
from tests.models.paged import paged_prefill_and_greedy
from tidal.layers.parallel import parallelize
from tidal.loader.model_loader import load_model, read_arch
from tidal.loader.shard import ShardPlan
from tidal.quant.registry import quantize_model

PROMPTS = [list(range(3, 40)), [9, 2, 40, 41, 60, 3, 8], [5, 17, 33]]
MAX_NEW = 20
FAMILIES = ("llama", "qwen2", "gemma3")


def _tiny_hf(family: str, out_dir: Path) -> Path:
    import transformers as tf

    from tests.models.tiny_hf import tiny_config

    torch.manual_seed(0)
    config = tiny_config(family)
    config.intermediate_size = 128  # int8's groups of 32 then fall whole on each rank
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if p.ndim == 1 else 0.15)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, str]]:
    """(name, checkpoint path, mode) for every comparison, run by one group of ranks."""
    root = tmp_path_factory.mktemp("tp")
    out = []
    for family in FAMILIES:
        path = str(_tiny_hf(family, root / family))
        out += [(f"{family}-float", path, "none"), (f"{family}-int8", path, "int8")]
    gguf = root / "tiny-q.gguf"
    # Row-parallel o_proj splits its 256 inputs in two: Q8_0's blocks of 32 divide 128.
    write_tiny_quantized_gemma(gguf, types={"attn_output": Q.Q8_0})
    out.append(("gguf-blocks", str(gguf), "gguf"))
    return out


def _run(path: str, mode: str, tensor_parallel: tuple[int, int] | None):
    loaded = load_model(path, gguf_blocks=mode == "gguf", tensor_parallel=tensor_parallel)
    if mode == "int8":
        quantize_model(loaded.model, "int8")
    if loaded.shard is not None:
        parallelize(loaded.model, loaded.shard, None)
    return paged_prefill_and_greedy(loaded.model, loaded.arch, PROMPTS, MAX_NEW)


def _rank(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    return {name: _run(path, mode, (rank, world)) for name, path, mode in cases}


@pytest.fixture(scope="module")
def sharded(cases: list[tuple[str, str, str]]) -> dict:
    ranks = run_ranks(_rank, 2, cases)
    # Every rank gathered the same logits.
    for name, _, _ in cases:
        for a, b in zip(ranks[0][name][0], ranks[1][name][0], strict=True):
            assert torch.equal(a, b), name
    return ranks[0]


@pytest.mark.parametrize("case", range(7))
def test_two_ranks_match_one(cases: list, sharded: dict, case: int) -> None:
    name, path, mode = cases[case]
    ref_logits, ref_tokens = _run(path, mode, None)
    logits, tokens = sharded[name]
    if mode == "none":
        diff = max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits, strict=True))
        print(f"{name}: max |logit diff| TP=2 vs TP=1 = {diff:.2e}")
        assert diff < 1e-4, name
    assert tokens == ref_tokens, name


def test_bad_degrees_are_refused(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny-q.gguf"
    write_tiny_quantized_gemma(gguf)  # o_proj in Q4_K: blocks of 256 columns
    with pytest.raises(ValueError, match=r"hardware\.tensor_parallel.*attn.*block boundaries"):
        load_model(gguf, gguf_blocks=True, tensor_parallel=(0, 2))
    arch, _ = read_arch(gguf)  # 2 query heads, 1 KV head
    with pytest.raises(ValueError, match=r"^hardware\.tensor_parallel=3 is invalid.*2 attention"):
        ShardPlan(arch, 0, 3)
