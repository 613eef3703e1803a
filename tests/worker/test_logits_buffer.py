"""How the model runner holds logits. The sampled rows' go into one buffer kept from step to
step (where the LM head is a GGUF block matrix on the CPU): the same tokens and logprobs as
logits allocated afresh, one buffer for every step of a run, and none kept once the engine
idles. Scored prompt rows' logits come a block of rows at a time: the same prompt logprobs as
a whole span's at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loader.test_weight_cache import write_tiny_quantized_gemma
from tidal import LLM, SamplingParams
from tidal.scheduler.output import SchedulerOutput
from tidal.worker import model_runner
from tidal.worker.model_runner import ModelRunner

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 30, 2], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]


def _run(path: Path) -> tuple[list, ModelRunner]:
    # One sampled row per sequence a step: no prompt-lookup drafts.
    llm = LLM(str(path), kv_cache_bytes=8 << 20, block_size=8, max_num_seqs=4,
              num_speculative_tokens=0)  # fmt: skip
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    runner = llm.engine.runner
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], runner


def test_sampled_logits_reuse_one_buffer_with_the_same_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    buffers: list = []  # held, so a freed buffer's address cannot come back as a "new" one
    real = ModelRunner._logits_out

    def spy(self: ModelRunner, num_rows: int):
        out = real(self, num_rows)
        assert out is not None, "a GGUF LM head on the CPU writes into the buffer"
        assert out.data_ptr() == self._logits.data_ptr() and out.shape[0] == num_rows
        buffers.append(self._logits)
        return out

    monkeypatch.setattr(ModelRunner, "_logits_out", spy)
    reused, runner = _run(path)
    # One buffer for all steps, grown only when a step samples more rows than any before.
    assert len(buffers) >= PARAMS.max_tokens and len({id(b) for b in buffers}) <= len(PROMPTS)
    assert runner._logits is not None and runner._logits.shape[0] == len(PROMPTS)
    runner.execute(SchedulerOutput())  # an empty step, as the serving loop runs when it idles
    assert runner._logits is None

    monkeypatch.setattr(ModelRunner, "_logits_out", lambda self, num_rows: None)
    fresh, _ = _run(path)
    assert reused == fresh  # token ids and logprobs, exactly


def test_prompt_logprobs_come_a_block_of_rows_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    prompt = [1] + [(7 * i) % 60 + 3 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    blocks: list[int] = []
    real = ModelRunner.forward

    def spy(self: ModelRunner, inputs, on_prompt_logits=None):
        def counted(span: int, row: int, logits) -> None:
            blocks.append(logits.shape[0])
            on_prompt_logits(span, row, logits)

        return real(self, inputs, counted if on_prompt_logits else None)

    results = {}
    for rows in (6, 10_000):
        monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", rows)
        monkeypatch.setattr(ModelRunner, "forward", spy)
        llm = LLM(
            str(path),
            kv_cache_bytes=8 << 20,
            block_size=8,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            cpu_budget_step_ms=None,  # a fixed budget: 24-token chunks whatever the host's load
        )
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        results[rows] = (out.prompt_logprobs, out.outputs[0].token_ids)
    assert max(blocks) == 24 and 6 in blocks  # chunked prefill's spans whole, 6-row blocks
    assert len(results[6][0]) == len(prompt) and results[6] == results[10_000]
