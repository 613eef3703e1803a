"""bfloat16 on CPU against transformers in bfloat16 on the same tiny random checkpoints: logits within
bf16's own rounding noise, greedy tokens identical except where bf16 itself cannot tell two apart."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.paged import PagedBatch, paged_prefill, paged_prefill_and_greedy
from tests.models.test_vs_transformers import FAMILIES, PROMPTS
from tests.models.tiny_hf import make_tiny_model
from tidal.loader.model_loader import load_model

MAX_NEW = 20
# Tolerance. bf16 keeps 8 significant bits (a relative rounding step of 2**-8 ~ 0.4%), and a
# model rounds every matmul output, norm and residual add, so two correct bf16 implementations
# that round at different points (fused qkv, the paged attention's gather, float32 softmax)
# differ from float32 by about the same amount, in independent directions. The yardstick is
# therefore transformers' own bf16 error against its float32 run, E = max|hf_bf16 - hf_fp32|:
# tidal's bf16 logits must stay within 2 E of float32 (its error no larger than twice the
# reference's), hence within 3 E of hf's bf16. The floor keeps E from being unrealistically small
# on a prompt where bf16 happens to round well. A real bug (a wrong mask, rope or norm) moves
# logits by whole units, far past this, as the float32 test's 1e-4 shows for the same models.
ERROR_FACTOR = 2.0
ERROR_FLOOR = 0.05


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"{request.param}_bf16")
    hf32 = make_tiny_model(request.param, path)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    refs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            ref32 = hf32(ids).logits[0].float()  # (T, V)
            ref16 = hf16(ids).logits[0].float()  # (T, V)
            gen = hf16.generate(
                ids,
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = gen.sequences[0, len(prompt) :].tolist()
            steps = torch.stack([s[0].float() for s in gen.scores])  # (MAX_NEW, V)
            refs.append((ref32, ref16, tokens, steps))
    loaded = load_model(path, torch.bfloat16)
    return request.param, loaded, refs


def _margin(row: torch.Tensor) -> float:
    """How far the top logit stands above the second: below the tolerance, bf16 cannot rank them."""
    top2 = row.topk(2).values
    return float(top2[0] - top2[1])


def test_weights_are_bf16(tiny) -> None:
    _, loaded, _ = tiny
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def _teacher_forced(loaded, chunk: int | None, forced: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, tidal's logits for each of MAX_NEW decode steps when fed transformers' greedy
    tokens: the decode path (one token per sequence per step through the paged KV) compared row
    for row, even after a near-tie would have sent the two greedy paths apart. (MAX_NEW, V) each."""
    batch = PagedBatch(loaded.model, loaded.arch, max(map(len, PROMPTS)) + MAX_NEW, len(PROMPTS))
    # The last prompt row predicts the first new token.
    rows = [[pl[-1]] for pl in paged_prefill(batch, PROMPTS, chunk)]
    for step in range(MAX_NEW - 1):
        starts = [len(p) + step for p in PROMPTS]
        logits = batch.step([[f[step]] for f in forced], starts, list(range(len(PROMPTS))))
        for i, row in enumerate(logits):
            rows[i].append(row)
    return [torch.stack(r).float() for r in rows]


@pytest.mark.parametrize("chunk", [None, 4])
def test_bf16_logits_and_greedy_match_transformers(tiny, chunk: int | None) -> None:
    family, loaded, refs = tiny
    logits, outs = paged_prefill_and_greedy(
        loaded.model, loaded.arch, PROMPTS, max_new=MAX_NEW, chunk=chunk
    )
    forced_rows = _teacher_forced(loaded, chunk, [tokens for _, _, tokens, _ in refs])
    for prompt, ours, out, forced, (ref32, ref16, tokens, steps) in zip(
        PROMPTS, logits, outs, forced_rows, refs
    ):
        ours = ours.float()  # the LM head hands back float32 logits from bf16 hidden states
        hf_error = (ref16 - ref32).abs().max().item()
        tol = max(ERROR_FLOOR, ERROR_FACTOR * hf_error)
        err = (ours - ref32).abs().max().item()
        vs_hf16 = (ours - ref16).abs().max().item()
        decode_err = (forced - steps).abs().max().item()
        print(
            f"{family} chunk={chunk} len={len(prompt)}: max|tidal_bf16 - fp32|={err:.3g}, "
            f"max|hf_bf16 - fp32|={hf_error:.3g}, max|tidal_bf16 - hf_bf16|={vs_hf16:.3g} "
            f"(decode steps {decode_err:.3g}), tol={tol:.3g}"
        )
        assert err <= tol
        assert vs_hf16 <= tol + hf_error
        # Decode rows against transformers' bf16 scores on the same tokens: both are bf16 runs,
        # so each sits within the bf16 noise of the (unmeasured) float32 row; 2 tol bounds both.
        assert decode_err <= 2 * tol
        # Argmax agreement wherever the reference ranks its top two further apart than the noise.
        ranked = 0
        for pos in range(len(prompt)):
            if _margin(ref32[pos]) > 2 * tol:
                assert int(ours[pos].argmax()) == int(ref32[pos].argmax()), (family, pos)
                ranked += 1
        for step in range(MAX_NEW):
            if _margin(steps[step]) > 2 * tol:
                assert int(forced[step].argmax()) == tokens[step], (family, len(prompt), step)
                ranked += 1
        # Free-running greedy: identical tokens up to the first step where transformers' bf16
        # top two are within the noise (a near-tie either side may break); there the paths part.
        same = 0
        for step, (got, want) in enumerate(zip(out, tokens, strict=True)):
            if _margin(steps[step]) <= 2 * tol:
                break
            assert got == want, (family, len(prompt), step, out, tokens)
            same += 1
        print(f"  argmax checked at {ranked} positions; greedy identical for {same}/{MAX_NEW}")
