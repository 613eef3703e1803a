"""The bundled Gemma 3 270M GGUF in tidal against transformers' logits and greedy tokens on the same
file (fixtures from tests/models/reference_gguf.py), run as one ragged paged batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.models.paged import paged_prefill_and_greedy
from tidal.loader.model_loader import load_model
from tidal.loader.tokenizer import load_tokenizer

FIXTURE = json.loads(
    (Path(__file__).parent / "fixtures" / "gemma3_270m_q4_k_m_reference.json").read_text()
)
# transformers' own logits move by ~1.8e-5 between 1 and 2 threads; the fixture's tolerance is 10x
# that (tidal measured: at most 7.6e-6 on these prompts).
LOGIT_ATOL = FIXTURE["tolerance"]["logit_atol"]


@pytest.fixture(scope="module")
def bundled(bundled_gguf):
    return load_model(bundled_gguf, torch.float32)


def test_tokenizer_matches_transformers(bundled_gguf):
    tok = load_tokenizer(bundled_gguf, "gemma3")
    for case in FIXTURE["prompts"]:
        add_bos = case["name"] != "chat" or not case["text"].startswith("<bos>")
        assert tok.encode(case["text"], add_special_tokens=add_bos) == case["prompt_ids"], case[
            "name"
        ]


def test_logits_and_greedy_match_transformers(bundled):
    prompts = [c["prompt_ids"] for c in FIXTURE["prompts"]]
    logits, outs = paged_prefill_and_greedy(
        bundled.model, bundled.arch, prompts, max_new=FIXTURE["max_new_tokens"], chunk=None
    )
    for case, ours, out in zip(FIXTURE["prompts"], logits, outs):
        worst = 0.0
        for pos, ids, ref in zip(case["positions"], case["top_ids"], case["top_logits"]):
            got = ours[pos, torch.tensor(ids)]
            worst = max(worst, (got - torch.tensor(ref)).abs().max().item())
            assert int(ours[pos].argmax()) == ids[0]
        print(f"{case['name']}: max |logit diff| over top-{FIXTURE['top_k']} = {worst:.2e}")
        assert worst < LOGIT_ATOL, case["name"]
        assert out == case["greedy_ids"], case["name"]
