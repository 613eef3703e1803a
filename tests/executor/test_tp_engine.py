"""The engine over a tensor-parallel group (two local gloo ranks): the same greedy tokens, token
logprobs and prompt logprobs as one process, for a ragged batch with a shared prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal import LLM, SamplingParams

PROMPTS = [list(range(3, 40)), list(range(3, 30)) + [9, 2], [5, 17, 33]]


def _generate(path: Path, **kwargs) -> list[tuple]:
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    with LLM(
        str(path), kv_cache_bytes=1 << 22, max_num_batched_tokens=24, max_num_seqs=4, **kwargs
    ) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        if kwargs:  # the group really ran: rank 0 here and one more rank
            assert llm.engine.runner.group.spec.world_size == 2
    got = []
    for o in outs:
        c = o.outputs[0]
        prompt_lp = [None if e is None else sorted(e.items()) for e in o.prompt_logprobs]
        got.append((c.token_ids, [sorted(e.items()) for e in c.logprobs], prompt_lp))
    return got


def test_engine_with_two_ranks_matches_one(gemma: Path, reference: list[tuple]) -> None:
    ref = reference
    got = _generate(gemma, tensor_parallel_size=2)
    for (ids, lps, plps), (ref_ids, ref_lps, ref_plps) in zip(got, ref, strict=True):
        assert ids == ref_ids
        for a, b in zip(lps + plps[1:], ref_lps + ref_plps[1:], strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            for (_, x), (_, y) in zip(a, b):
                assert abs(x.logprob - y.logprob) < 1e-4


def test_a_degree_the_model_cannot_split_is_refused(gemma: Path) -> None:
    with pytest.raises(ValueError, match=r"^hardware\.tensor_parallel=3 is invalid.*4 attention"):
        LLM(str(gemma), tensor_parallel_size=3)


def test_the_ray_backend_without_ray_is_refused(
    gemma: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray' needs Ray: pip"):
        LLM(str(gemma), tensor_parallel_size=2, distributed_executor_backend="ray")


def test_a_hung_rank_loses_the_group_within_the_timeout(
    gemma: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidal.executor.errors import GroupLost

    monkeypatch.setenv("TIDAL_RANK_FAULT", "hang_on_step=3")  # read by the worker rank only
    llm = LLM(str(gemma), tensor_parallel_size=2, collective_timeout_s=3, kv_cache_bytes=1 << 22,
              max_num_seqs=4, max_num_batched_tokens=24)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        with pytest.raises(GroupLost, match=r"a step failed on rank 0"):
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        with pytest.raises(GroupLost):  # the group stays lost: no step runs on a broken group
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)
    finally:
        llm.shutdown()
    worker = llm.engine.runner.group.workers[0]
    assert worker.poll() is not None  # the hung rank was ended, not left behind
