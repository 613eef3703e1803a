"""The static-batching baseline decodes exactly what tidal decodes, batches the way a static batcher
does, and the offline benchmark's JSON record adds up (speed is never asserted)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from tests.engine.tiny import make_tiny_model_dir
from tidal import LLM, SamplingParams
from tidal.bench.offline import main, percentile
from tidal.bench.static_batching import StaticBatcher
from tidal.bench.workload import make_workload

VOCAB = 320
WORKLOAD = dict(min_prompt_len=2, max_prompt_len=40, min_tokens=1, max_tokens=12, bos_token_id=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("bench-tiny"), "gemma3")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    # One thread: a tiny model's ops are too small to split, and when the machine's cores are
    # busy a second OpenMP thread makes every op wait for it. Restored for later test modules.
    before = torch.get_num_threads()
    yield LLM(str(tiny_dir), kv_cache_bytes=8 << 20, block_size=8, max_num_seqs=4, threads=1)
    torch.set_num_threads(before)


@pytest.fixture()
def restore_threads():
    # --threads sets torch's process-wide thread count; put it back for the tests that follow.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _tidal_tokens(llm: LLM, work, **params) -> list[list[int]]:
    outs = llm.generate(
        prompt_token_ids=[w.prompt_token_ids for w in work],
        sampling_params=[SamplingParams(temperature=0, max_tokens=w.max_tokens, **params) for w in work],
    )  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def _batcher(tiny_dir, batch_size: int, **kwargs) -> StaticBatcher:
    # The same engine settings as the `llm` fixture, so only the schedule differs.
    kwargs = {"kv_cache_bytes": 8 << 20, "block_size": 8, "threads": 1, **kwargs}
    return StaticBatcher(str(tiny_dir), batch_size, **kwargs)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_static_greedy_equals_tidal(llm, tiny_dir, batch_size):
    work = make_workload(10, 0, VOCAB, **WORKLOAD)
    assert len({len(w.prompt_token_ids) for w in work}) > 3  # really padded
    expected = _tidal_tokens(llm, work, ignore_eos=True)
    results = _batcher(tiny_dir, batch_size).generate(
        [w.prompt_token_ids for w in work], [w.max_tokens for w in work], ignore_eos=True
    )
    assert [r.token_ids for r in results] == expected
    assert [len(r.token_ids) for r in results] == [w.max_tokens for w in work]
    assert [r.prompt_token_ids for r in results] == [w.prompt_token_ids for w in work]


def test_static_stops_on_eos_like_tidal_stop_ids(llm, tiny_dir):
    work = make_workload(6, 1, VOCAB, **{**WORKLOAD, "min_tokens": 12})
    free = _tidal_tokens(llm, work, ignore_eos=True)
    stop_id = free[0][3]  # a token the first request emits, so at least one row stops early
    expected = _tidal_tokens(llm, work, ignore_eos=True, stop_token_ids=[stop_id])
    assert len(expected[0]) == free[0].index(stop_id) + 1
    results = _batcher(tiny_dir, 4, eos_token_ids={stop_id}).generate(
        [w.prompt_token_ids for w in work], [w.max_tokens for w in work]
    )
    assert [r.token_ids for r in results] == expected


def test_static_admits_nothing_until_the_batch_ends(tiny_dir):
    ticks = itertools.count()  # a clock that advances one unit per reading
    work = make_workload(7, 2, VOCAB, **WORKLOAD)
    results = _batcher(tiny_dir, 3, clock=lambda: float(next(ticks))).generate(
        [w.prompt_token_ids for w in work], [w.max_tokens for w in work], ignore_eos=True
    )
    batches = [results[0:3], results[3:6], results[6:7]]
    for batch in batches:
        assert len({r.batch_end_time_s for r in batch}) == 1
        assert len({r.first_token_time_s for r in batch}) == 1
        # The longest row ends the batch; shorter rows finished earlier but kept their slot.
        longest = max(len(r.token_ids) for r in batch)
        for r in batch:
            assert r.first_token_time_s <= r.finished_time_s < r.batch_end_time_s
            # one clock reading per decode step after the prefill's
            assert r.finished_time_s - r.first_token_time_s == len(r.token_ids) - 1
        assert max(r.finished_time_s for r in batch) - batch[0].first_token_time_s == longest - 1
    for before, after in itertools.pairwise(batches):
        assert after[0].first_token_time_s > before[0].batch_end_time_s


def test_static_rejects_bad_input(tiny_dir):
    with pytest.raises(ValueError, match="batch_size=0"):
        _batcher(tiny_dir, 0)
    # The settings that make the schedule static are the batcher's: refused, never overridden.
    with pytest.raises(ValueError, match="got enable_prefix_caching, max_num_seqs: the static"):
        _batcher(tiny_dir, 2, enable_prefix_caching=True, max_num_seqs=8)
    batcher = _batcher(tiny_dir, 2, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="max_tokens"):
        batcher.generate([[1, 5]], [0])
    with pytest.raises(ValueError, match="context length 256"):
        batcher.generate([[1] * 200], [100])
    # One step prefills the whole batch: two prompts of 200 do not fit a 256-token step.
    with pytest.raises(ValueError, match="400 tokens: expected at most max_num_batched_tokens"):
        batcher.generate([[1] * 200, [2] * 200], [1, 1])


def test_static_refuses_a_batch_it_cannot_run_in_lockstep(tiny_dir):
    # KV for about one sequence of 40 tokens: the engine cannot hold the batch at once, so it
    # would not be a static batch; the times would be wrong, so the batcher says so.
    batcher = _batcher(tiny_dir, 4, kv_cache_bytes=_kv_bytes_for_tokens(tiny_dir, 48))
    work = make_workload(4, 5, VOCAB, **{**WORKLOAD, "min_prompt_len": 30, "min_tokens": 8})
    with pytest.raises(RuntimeError, match="did not run the batch of 4 in lockstep"):
        batcher.generate(
            [w.prompt_token_ids for w in work], [w.max_tokens for w in work], ignore_eos=True
        )


def _kv_bytes_for_tokens(tiny_dir, num_tokens: int) -> int:
    """A KV budget of the null block plus one sequence of num_tokens in every KV group."""
    layout = LLM(str(tiny_dir), kv_cache_bytes=1 << 20, block_size=8).engine.layout
    return layout.page_bytes * (1 + len(layout.groups) * -(-num_tokens // 8))


def test_workload_is_seeded_and_in_range():
    a = make_workload(50, 3, 1000, min_prompt_len=4, max_prompt_len=300, bos_token_id=2)
    assert a == make_workload(50, 3, 1000, min_prompt_len=4, max_prompt_len=300, bos_token_id=2)
    assert a != make_workload(50, 4, 1000, min_prompt_len=4, max_prompt_len=300, bos_token_id=2)
    lens = [len(w.prompt_token_ids) for w in a]
    assert min(lens) >= 4 and max(lens) <= 300 and min(lens) < 20 and max(lens) > 100
    assert all(16 <= w.max_tokens <= 256 for w in a)
    assert all(w.prompt_token_ids[0] == 2 for w in a)
    assert all(3 <= t < 1000 for w in a for t in w.prompt_token_ids[1:])
    with pytest.raises(ValueError, match="min_prompt_len/max_prompt_len"):
        make_workload(1, 0, 1000, min_prompt_len=10, max_prompt_len=5)


def test_percentile_matches_numpy():
    values = [5.0, 1.0, 9.5, 3.25, 7.0, 2.0, 8.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12)


def test_offline_benchmark_record_adds_up(tiny_dir, tmp_path, restore_threads, capsys):
    out = tmp_path / "bench.json"
    args = ["--model", str(tiny_dir), "--num-prompts", "8", "--batch-size", "3", "--threads", "1"]
    args += ["--min-prompt-len", "2", "--max-prompt-len", "40", "--min-tokens", "1"]
    args += ["--max-tokens", "12", "--kv-cache-bytes", str(8 << 20), "--json", str(out)]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["tidal", "static", "ratio"]
    rec = json.loads(out.read_text())
    tok = LLM(str(tiny_dir), kv_cache_bytes=1 << 20).get_tokenizer()
    work = make_workload(
        8, 0, VOCAB, min_prompt_len=2, max_prompt_len=40, min_tokens=1, max_tokens=12,
        bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    prompt_tokens = sum(len(w.prompt_token_ids) for w in work)
    output_tokens = sum(w.max_tokens for w in work)
    for name in ("tidal", "static"):
        s = rec[name]
        assert (s["num_requests"], s["num_prompt_tokens"], s["num_output_tokens"]) == (
            8,
            prompt_tokens,
            output_tokens,
        )
        assert s["requests_per_s"] * s["elapsed_s"] == pytest.approx(8)
        assert s["output_tokens_per_s"] * s["elapsed_s"] == pytest.approx(output_tokens)
        assert s["total_tokens_per_s"] * s["elapsed_s"] == pytest.approx(
            prompt_tokens + output_tokens
        )
        assert 0 < s["ttft_mean_s"] <= s["latency_mean_s"] <= s["latency_p99_s"]
        assert s["latency_p50_s"] <= s["latency_p99_s"] <= s["elapsed_s"]
    for key, value in rec["ratio_tidal_over_static"].items():
        assert value == pytest.approx(rec["tidal"][key] / rec["static"][key])
    assert rec["identical_outputs"] == 8
    assert (rec["num_prompts"], rec["batch_size"], rec["dtype"], rec["threads"]) == (
        8,
        3,
        "float32",
        1,
    )


def test_decode_mode_record(tiny_dir, tmp_path, restore_threads):
    out = tmp_path / "decode.json"
    args = ["--mode", "decode", "--model", str(tiny_dir), "--threads", "1", "--json", str(out)]
    args += ["--decode-tokens", "3", "--prefill-len", "16", "--kv-cache-bytes", str(8 << 20)]
    args += ["--decode-batches", "1,3"]
    assert main(args) == 0
    rec = json.loads(out.read_text())
    loaded = LLM(str(tiny_dir), kv_cache_bytes=1 << 20).engine.loaded
    params = {id(p): p for p in loaded.model.parameters()}.values()
    assert rec["param_bytes"] == sum(4 * p.numel() for p in params)
    assert not any(key.startswith("decode_") and key[7:] not in ("1", "3") for key in rec)
    for b in (1, 3):
        d = rec[f"decode_{b}"]
        assert d["num_seqs"] == b and d["tok_s"] > 0
        assert d["weights_gb_s"] == pytest.approx(rec["param_bytes"] * d["tok_s"] / b / 1e9)
    assert rec["prefill"]["prompt_len"] == 16 and rec["prefill"]["tok_s"] > 0
