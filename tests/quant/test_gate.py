"""The accuracy gate's arithmetic on a tiny model: perplexity is exp(mean NLL) computed by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.engine.tiny import make_tiny_model_dir
from tests.models.paged import PagedBatch
from tidal import LLM, SamplingParams
from tidal.loader.model_loader import load_model
from tidal.loader.tokenizer import load_tokenizer
from tidal.worker.gate import (
    GateFailed,
    TokenScores,
    compare,
    enforce,
    heldout_text,
    main,
    perplexity,
    run_gate,
    score_tokens,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_gemma"))


def test_heldout_text_is_long_and_headerless() -> None:
    text = heldout_text()
    assert not text.startswith("#") and "CC0" not in text
    assert len(text.split()) > 1500


def test_scores_equal_log_softmax_by_hand(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir)
    ids = load_tokenizer(tiny_dir).encode(heldout_text())[:100]
    scores = score_tokens(loaded, ids, context_tokens=40, piece_tokens=16)
    assert scores.nll.numel() == 39 + 39 + 19  # chunks of 40, 40 and 20 tokens
    by_hand = []
    for start in (0, 40, 80):
        chunk = ids[start : start + 40]
        batch = PagedBatch(loaded.model, loaded.arch, len(chunk), 1)
        logits = batch.step([chunk], [0], [0]).double()  # whole chunk in one pass
        logp = torch.log_softmax(logits[:-1], dim=-1)
        by_hand.append(-logp[torch.arange(len(chunk) - 1), torch.tensor(chunk[1:])])
        by_hand_argmax = logits[:-1].argmax(-1)
        assert torch.equal(
            scores.argmax[len(torch.cat(by_hand)) - len(chunk) + 1 : len(torch.cat(by_hand))],
            by_hand_argmax,
        )
    nll = torch.cat(by_hand)
    torch.testing.assert_close(scores.nll, nll, rtol=0, atol=1e-5)
    assert perplexity(scores.nll) == pytest.approx(
        math.exp(sum(scores.nll.tolist()) / 97), rel=1e-12
    )
    assert perplexity(scores.nll) == pytest.approx(math.exp(nll.sum().item() / 97), rel=1e-6)


def test_scores_are_the_engines_prompt_logprobs(tiny_dir: Path) -> None:
    # The gate runs the engine's own runner: its scores are the prompt logprobs a user gets from
    # the engine for the same text, the top-1 included (up to the summation order of another
    # prefill split: the engine prefills each chunk in one step, the gate in pieces of 16).
    loaded = load_model(tiny_dir)
    ids = load_tokenizer(tiny_dir).encode(heldout_text())[:80]
    scores = score_tokens(loaded, ids, context_tokens=40, piece_tokens=16)
    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_dir), kv_cache_bytes=1 << 22, threads=1, enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        outs = llm.generate(prompt_token_ids=[ids[:40], ids[40:80]], sampling_params=params)
    finally:
        torch.set_num_threads(before)  # LLM(threads=1) set it for the whole process
    nll, top = [], []
    for out, chunk in zip(outs, (ids[:40], ids[40:80])):
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry is not None
            nll.append(-entry[chunk[pos]].logprob)
            top.append(next(t for t, lp in entry.items() if lp.rank == 1))
    torch.testing.assert_close(
        scores.nll, torch.tensor(nll, dtype=torch.float64), rtol=0, atol=1e-5
    )
    assert scores.argmax.tolist() == top


def test_compare_arithmetic() -> None:
    ref = TokenScores(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([5, 6, 7]))
    quant = TokenScores(torch.tensor([1.0, 2.0, 3.3], dtype=torch.float64), torch.tensor([5, 0, 7]))
    report = compare(ref, quant, "int8", 64, threshold_pct=11.0)
    assert report.ppl_ref == pytest.approx(math.exp(2.0))
    assert report.ppl_quant == pytest.approx(math.exp(2.1))
    assert report.change_pct == pytest.approx(100 * (math.exp(0.1) - 1))  # 10.517%
    assert report.top1_agreement == pytest.approx(2 / 3)
    assert report.passed and report.num_tokens == 3
    strict = compare(ref, quant, "int8", 64, threshold_pct=10.0)
    assert not strict.passed
    with pytest.raises(GateFailed, match="FAIL int8"):
        enforce(strict)
    enforce(strict, force=True)
    with pytest.raises(ValueError, match="perplexity needs"):
        perplexity(torch.tensor([]))


def test_run_gate_on_tiny_model(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_gate(tiny_dir, "int8", threshold_pct=5.0, context_tokens=48, max_tokens=97)
    assert report.num_tokens == 47 + 47 - 1 + 1  # chunks of 48, 48 and 1 (the last scores none)
    assert report.change_pct == pytest.approx(100 * (report.ppl_quant / report.ppl_ref - 1))
    assert report.summary is not None
    assert report.summary.weight_bytes_after < report.summary.weight_bytes_before
    # A random tiny model is nearly flat, so int8 barely moves it.
    assert abs(report.change_pct) < 1.0 and report.top1_agreement > 0.9
    args = ["--model", str(tiny_dir), "--quantization", "int8", "--max-tokens", "40"]
    assert main([*args, "--threshold-pct", "50"]) == 0
    assert "PASS int8" in capsys.readouterr().out
    with pytest.raises(ValueError, match="quantization='int3' is invalid"):
        run_gate(tiny_dir, "int3")
