"""`tidal bench kernels`: llama.cpp's outputs parse, the figures add up, and tidal's side runs on a
tiny model (speed is never asserted)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pytest
import torch

from tests.engine.tiny import make_tiny_model_dir
from tidal.bench.baselines import IK_LLAMA_CPP, LLAMA_CPP, build_flavor
from tidal.bench.cli import add_parser
from tidal.bench.kernels import (
    KernelsConfig,
    cpu_flags,
    kernel_paths,
    parse_sampling_args,
    parse_tidal_args,
    run_tidal,
)
from tidal.bench.kernels_report import Row, markdown_report
from tidal.bench.llama_bench import (
    Measure,
    describe_exit,
    llama_commands,
    parse_batched_bench,
    parse_llama_bench,
    run_baseline,
)
from tidal.bench.step_profile import StepProfile, profile_markdown, split_events
from tidal.layers.sampler import Sampler

# `llama-bench -m gemma-3-270m-q4_k_m.gguf -t 2 -p 64 -n 16 -r 2 -o json` (stdout) of the
# llama.cpp that scripts/build_llama_server.sh builds (0.3.36's vendor/, build 1, commit 0c1e570);
# the second test trimmed to the fields the parser reads. Timed on a busy box: slow.
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/root/.cache/tidal/gemma-3-270m-q4_k_m.gguf",
    "model_type": "gemma3 270M Q4_K - Medium",
    "model_size": 246587904,
    "model_n_params": 268098176,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 64,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-01T06:26:22Z",
    "avg_ns": 3393396887,
    "stddev_ns": 987901754,
    "avg_ts": 19.694758,
    "stddev_ts": 5.733631,
    "samples_ns": [ 4091948915, 2694844860 ],
    "samples_ts": [ 15.6405, 23.749 ]
  },
  {
    "build_commit": "0c1e570",
    "n_prompt": 0,
    "n_gen": 16,
    "avg_ts": 2.870463,
    "stddev_ts": 3.278477,
    "samples_ns": [ 28973432958, 3083626097 ],
    "samples_ts": [ 0.55223, 5.1887 ]
  }
]
"""

# `llama-batched-bench -m ... -t 2 -c 160 -b 2048 -ub 512 -npp 4 -ntg 16 -npl 8` (stdout), and the
# same case as `--output-format jsonl` writes it.
BATCHED_MD = """
llama_batched_bench: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     4 |     16 |    8 |    160 |    4.629 |     6.91 |   25.120 |     5.10 |   29.749 |     5.38 |

"""
BATCHED_JSONL = (
    '{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 4, "tg": 16, "pl": 8, '
    '"n_kv": 160, "t_pp": 4.629000, "speed_pp": 6.910000, "t_tg": 25.120000, '
    '"speed_tg": 5.100000, "t": 29.749000, "speed": 5.380000}\n'
)


# ik_llama.cpp (8337e4c, built by scripts/build_ik_llama.sh) on the same GGUF, recorded:
# `llama-bench -m gemma-3-270m-q4_k_m.gguf -t 2 -p 64 -n 16 -r 2 -o json [-rtr 1]` (stdout: no
# "backends" but a flag per backend, "mla_attn", "repack", the test's label "test"), and
# `llama-batched-bench -m ... -t 2 -c 160 -b 2048 -ub 512 -npp 4 -ntg 16 -npl 8 [-rtr]` (its
# table alone, on stderr, from its header on: it has no jsonl). Timed on an idle 2-core Xeon.
FIXTURES = Path(__file__).parent / "fixtures"
IK_BENCH = {label: (FIXTURES / f"ik_llama_bench{suffix}.json").read_text()
            for label, suffix in (("default", ""), ("-rtr 1", "_rtr"))}  # fmt: skip
IK_BATCHED = {label: (FIXTURES / f"ik_batched_bench{suffix}.txt").read_text()
              for label, suffix in (("default", ""), ("-rtr 1", "_rtr"))}  # fmt: skip


def test_parse_llama_bench_reads_both_tests_and_the_build() -> None:
    measures, build = parse_llama_bench("some log line [x]\n" + LLAMA_BENCH_JSON + "\n[trailing]")
    assert set(measures) == {"pp64", "tg16"}
    assert measures["pp64"].samples_tok_s == (15.6405, 23.749)
    assert measures["tg16"].median == pytest.approx((0.55223 + 5.1887) / 2)
    assert build["build_commit"] == "0c1e570" and build["backends"] == "CPU"
    assert build["build_number"] == 1 and build["n_threads"] == 2
    assert build["model_type"].startswith("gemma3")


def test_parse_llama_bench_rejects_text_without_json() -> None:
    with pytest.raises(ValueError, match="-o json"):
        parse_llama_bench("error: unknown argument\n")


@pytest.mark.parametrize("text", [BATCHED_MD, BATCHED_JSONL], ids=["md", "jsonl"])
def test_parse_batched_bench_reads_s_tg(text: str) -> None:
    rows = parse_batched_bench(text)
    assert len(rows) == 1
    row = rows[0]
    assert (row["pp"], row["tg"], row["pl"], row["n_kv"]) == (4, 16, 8, 160)
    assert row["speed_tg"] == pytest.approx(5.10)
    assert row["t_tg"] == pytest.approx(25.120)


def test_measure_and_ratio_math() -> None:
    m = Measure((10.0, 30.0, 20.0))
    assert m.median == 20.0 and m.spread == (10.0, 30.0) and m.stddev == pytest.approx(10.0)
    assert Measure((5.0,)).stddev is None
    assert Measure((1.0, 2.0, 3.0, 4.0)).median == 2.5
    row = Row("tg128", Measure((35.0, 36.0, 34.0)), Measure((70.0,)))
    assert row.ratio == pytest.approx(0.5)
    line = row.line()
    assert line.startswith("tg128") and "tidal" in line and "| llama.cpp" in line
    assert line.endswith("ratio 0.50") and "[34.0-36.0]" in line
    missing = Row("pp512", Measure((1.0,)), None)
    assert missing.ratio is None and missing.line().endswith("ratio -")
    record = m.record()
    assert record["median_tok_s"] == 20.0 and record["samples_tok_s"] == [10.0, 30.0, 20.0]


def test_batched_context_fits_every_sequence() -> None:
    cfg = KernelsConfig(threads=2, repetitions=3)
    bench, batched = llama_commands(cfg, "llama-bench", "llama-batched-bench", Path("m.gguf"))
    assert bench[bench.index("-p") + 1] == "512" and bench[bench.index("-n") + 1] == "128"
    assert bench[bench.index("-r") + 1] == "3" and bench[bench.index("-o") + 1] == "json"
    ctx = int(batched[batched.index("-c") + 1])
    assert ctx >= cfg.batch_seqs * (cfg.batch_prompt_tokens + cfg.decode_tokens)
    assert batched[batched.index("-npl") + 1] == "32" and batched[batched.index("-t") + 1] == "2"
    assert cfg.names() == ("pp512", "tg128", "b32-tg128")


def test_parse_tidal_args() -> None:
    got = parse_tidal_args(["quantization=int8", "max_num_seqs=8", "enable_prefix_caching=false",
                            "memory_fraction=0.5", "max_model_len=none"])  # fmt: skip
    assert got == {"quantization": "int8", "max_num_seqs": 8, "enable_prefix_caching": False,
                   "memory_fraction": 0.5, "max_model_len": None}  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_tidal_args(["int8"])
    with pytest.raises(ValueError, match="--threads"):
        parse_tidal_args(["threads=4"])


def test_parse_sampling_args_checks_fields_as_a_request_would() -> None:
    got = parse_sampling_args(["temperature=0.8", "top_p=0.95", "top_k=40", "seed=7"])
    assert got == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 7}
    assert parse_sampling_args([]) == {}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_sampling_args(["0.8"])
    with pytest.raises(ValueError, match="no 'temprature'"):
        parse_sampling_args(["temprature=0.8"])
    with pytest.raises(ValueError, match="sets max_tokens itself"):
        parse_sampling_args(["max_tokens=4"])
    with pytest.raises(ValueError, match="top_p"):
        parse_sampling_args(["top_p=1.5"])


def test_cpu_flags_from_cpuinfo() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma f16c avx512f\n"
    flags = cpu_flags(text)
    assert flags["avx2"] and flags["fma"] and flags["f16c"] and flags["avx512f"]
    assert not flags["avx512_vnni"] and not flags["amx_tile"]


def _record(rows: list[Row]) -> dict:
    return {
        "machine": {"cpu_model": "AMD EPYC 7B13", "cpu_count": 2},
        "cpu_flags": {"avx2": True, "fma": True, "avx512f": False},
        "threads": 2,
        "gguf": "/m.gguf",
        "repetitions": 3,
        "tidal": {"args": {"quantization": "int8"}, "torch": "2.x",
                  "config": {"hardware": {"dtype": "auto"}, "model": {"quantization": "int8"}}},
        "llama_cpp": {"build": {"build_number": 1, "build_commit": "0c1e570",
                                "backends": "CPU", "model_type": "gemma3"}, "notes": ["a note"]},
    }  # fmt: skip


def test_markdown_report_names_the_machine_and_every_measure() -> None:
    rows = [
        Row("pp512", Measure((300.0, 310.0, 290.0)), Measure((746.0,))),
        Row("tg128", Measure((35.0,)), None),
        Row("b32-tg128", None, Measure((235.0,))),
    ]
    steps = StepProfile(steps=32, num_layers=18, wall_s=0.036, native_s=0.0, aten_s=0.027)
    assert "| - `" not in profile_markdown(steps)
    named = StepProfile(1, 2, 1.0, 0.5, 0.25, (("tidal::gguf_gemm", 0.4), ("tidal::x", 0.1)))
    assert "| - `tidal::gguf_gemm` | 400.00 | 200.000 | 40% |" in profile_markdown(named)
    batched = StepProfile(32, 18, 0.04, 0.03, 0.001, (("tidal::decoder_stack", 0.03),), 32, 0.006)
    assert math.isclose(batched.other_s, 0.003)
    text = markdown_report(_record(rows), rows, (steps, batched))
    assert "AMD EPYC 7B13" in text and "has avx2 fma" in text and "lacks avx512f" in text
    assert "threads: 2" in text and "`/m.gguf`" in text and "quantization='int8'" in text
    assert "commit 0c1e570" in text and "- a note" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| measure |")
    assert table[1] == "| pp512 | 300.0 [290.0-310.0] | 746.0 [746.0-746.0] | 0.40 |"
    assert table[2] == "| tg128 | 35.0 [35.0-35.0] | - | - |"
    assert table[3].startswith("| b32-tg128 | - | 235.0")
    assert "| wall | 36.00 | 2.000 | 100% |" in text
    assert "| other (Python, scheduler, output, profiler) | 9.00 | 0.500 | 25% |" in text
    assert math.isclose(steps.other_s, 0.009)
    assert "dtype auto, quantization int8; torch 2.x" in text and "(gemma3)" in text
    assert (
        "Single-stream decode, 32 steps under torch.profiler, 18 layers; without the "
        "profiler: 28.57 ms per step:" in text
    )
    # the batched profile's own table; no rate beside it where tidal's b32 did not run
    assert "32 sequences decoding together, 32 steps under torch.profiler, 18 layers:" in text
    assert "| sampler (its kernels and Python) | 6.00 | 0.333 | 15% |" in text
    assert "torch 2.x; greedy" in text
    assert "tidal kernels" not in text  # a record without them (older JSON) has no such line
    lowered = {**_record(rows), "llama_cpp": {**_record(rows)["llama_cpp"], "bin_dir": "/b"}}
    lowered["tidal"] = {**lowered["tidal"], "kernels": {
        "paths": {"gguf_gemm": "avx2", "paged_attention": "avx2", "sample": None},
        "caps": {"TIDAL_KERNEL_ISA": "avx2"}}}  # fmt: skip
    lowered_text = markdown_report(lowered, rows)
    assert (
        "- tidal kernels: gguf_gemm avx2, paged_attention avx2, sample not built (lowered: "
        "TIDAL_KERNEL_ISA=avx2)" in lowered_text
    )
    assert "CPU; binaries from `/b`" in lowered_text
    sampled = {**_record(rows), "workload": {"sampling": {"temperature": 0.8, "top_p": 0.95}}}
    sampled_text = markdown_report(sampled, rows)
    assert "samples every token (temperature=0.8, top_p=0.95;" in sampled_text
    assert profile_markdown(batched).splitlines()[2:] == text.splitlines()[-8:]


def test_split_events_counts_native_regions_whole_and_aten_outside_them() -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("tidal::fake_kernel"):
            y = x @ x  # inside: counted in the region, not as aten
        z = (y + 1).sum()  # outside: aten
    del z
    native_us, aten_us = split_events(prof.events())
    events = prof.events()
    region = next(e for e in events if e.name == "tidal::fake_kernel")
    assert native_us == {"tidal::fake_kernel": pytest.approx(region.cpu_time_total)}
    outside = sum(
        e.self_cpu_time_total for e in events
        if e.name.startswith("aten::") and not _inside(e, "tidal::")
    )  # fmt: skip
    assert aten_us == pytest.approx(outside) and aten_us > 0


def _inside(e, prefix: str) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(prefix):
            return True
        p = p.cpu_parent
    return False


def test_kernel_paths_follow_the_isa_setting(monkeypatch) -> None:
    from tidal.kernels import gguf_gemm, paged_attention, sample

    def fresh() -> dict:
        for fn in (gguf_gemm.default_isa, paged_attention.default_isa, sample.default_isa):
            fn.cache_clear()
        return kernel_paths()

    try:
        monkeypatch.delenv("TIDAL_KERNEL_ISA", raising=False)
        best = fresh()
        assert "TIDAL_KERNEL_ISA" not in best["caps"]
        monkeypatch.setenv("TIDAL_KERNEL_ISA", "scalar")
        low = fresh()
        assert low["caps"]["TIDAL_KERNEL_ISA"] == "scalar"
        for name, path in low["paths"].items():
            assert path in (None, "scalar"), name
            assert (path is None) == (best["paths"][name] is None)
    finally:
        monkeypatch.undo()
        fresh()  # the cached paths again as the session set them


def test_batched_prompts_past_one_step_are_prefilled_first(tmp_path: Path, monkeypatch) -> None:
    """Prompts that take several prefill steps would put the later ones' prefills in the decode
    window: they are prefilled first (max_tokens=1, same prompts), and the timed run then takes
    every first token from one step (prefix-cache hits), as llama-batched-bench times S_TG."""
    from tidal import LLM

    model = make_tiny_model_dir(tmp_path / "tiny")
    cfg = KernelsConfig(threads=1, repetitions=1, prompt_tokens=24, decode_tokens=4,
                        batch_seqs=3, batch_prompt_tokens=24, tg_prompt_tokens=4,
                        profile_steps=2)  # fmt: skip
    assert cfg.names()[2] == "b3-pp24-tg4" and KernelsConfig().names()[2] == "b32-tg128"
    calls: list[tuple[list[list[int]], int, set[float]]] = []
    generate = LLM.generate

    def spy(self, *args, **kwargs):
        outs = generate(self, *args, **kwargs)
        firsts = {o.metrics.first_token_time_s for o in outs}
        calls.append((kwargs["prompt_token_ids"], kwargs["sampling_params"].max_tokens, firsts))
        return outs

    monkeypatch.setattr(LLM, "generate", spy)
    args = {"kv_cache_bytes": 8 << 20, "block_size": 8, "max_num_batched_tokens": 32}
    before = torch.get_num_threads()
    try:
        measures, _, steps = run_tidal(cfg, model, args, profile=True)
        with pytest.raises(ValueError, match="need the prefix cache"):
            run_tidal(cfg, model, {**args, "enable_prefix_caching": False}, profile=False)
    finally:
        torch.set_num_threads(before)
    assert "b3-pp24-tg4" in measures and [p.seqs for p in steps] == [1, 3]
    batched = [i for i, (prompts, n, _) in enumerate(calls) if len(prompts) == 3 and n > 1]
    assert len(batched) >= 3  # warm-up, the measure, the profile's two runs
    for i in batched:
        prompts, _, firsts = calls[i]
        assert all(len(p) == 24 for p in prompts)
        assert any(calls[j][0] == prompts and calls[j][1] == 1 for j in range(i))
        assert len(firsts) == 1, "every first token from one step"


def test_missing_binaries_leave_a_note(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-bench on PATH either
    measures, info = run_baseline(KernelsConfig(), tmp_path / "m.gguf", LLAMA_CPP, tmp_path)
    assert measures == {}
    assert "build_llama_server.sh" in info["notes"][0]


def _tool(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_a_tool_killed_by_sigill_leaves_a_note_that_says_why(tmp_path: Path) -> None:
    # real processes that die as a natively built llama.cpp does on a CPU with AMX tiles
    for name in ("llama-bench", "llama-batched-bench"):
        _tool(tmp_path / name, "echo loading >&2; kill -ILL $$")
    (tmp_path / "FLAVOR").write_text("native\n")
    measures, info = run_baseline(
        KernelsConfig(repetitions=1), tmp_path / "m.gguf", LLAMA_CPP, tmp_path
    )
    assert measures == {} and info["flavor"] == "native"
    assert len(info["notes"]) == 2
    for note in info["notes"]:
        assert "was killed by SIGILL" in note and "leaves AMX out" in note, note
        assert note.endswith(": loading")
    _tool(tmp_path / "llama-bench", "exit 3")
    _, info = run_baseline(KernelsConfig(repetitions=1), tmp_path / "m.gguf", LLAMA_CPP, tmp_path)
    assert info["notes"][0] == "llama-bench exited with 3: "


def test_describe_exit() -> None:
    assert describe_exit(0) == "exited with 0" and describe_exit(2) == "exited with 2"
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(-4, LLAMA_CPP).startswith("was killed by SIGILL (an illegal")
    assert "scripts/build_ik_llama.sh" in describe_exit(-4, IK_LLAMA_CPP)
    assert describe_exit(-4) == "was killed by SIGILL"
    assert describe_exit(-200) == "was killed by signal 200"


def test_report_names_the_build_flavor(tmp_path: Path) -> None:
    assert build_flavor(tmp_path) is None  # binaries from elsewhere: no FLAVOR
    (tmp_path / "FLAVOR").write_text("native without AMX (-mno-amx-tile)\n")
    assert build_flavor(tmp_path) == "native without AMX (-mno-amx-tile)"
    rows = [Row("pp512", Measure((300.0,)), Measure((746.0,)))]
    record = _record(rows)
    record["llama_cpp"] = {**record["llama_cpp"], "bin_dir": "/b", "flavor": build_flavor(tmp_path)}
    text = markdown_report(record, rows)
    assert "binaries from `/b`, built native without AMX (-mno-amx-tile)" in text


def test_command_is_registered() -> None:
    parser = argparse.ArgumentParser(prog="tidal")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "kernels", "--threads", "1", "--tidal-arg", "dtype=float32",
                              "--profile", "--no-llama", "--sampling", "temperature=0.8",
                              "--sampling", "top_p=0.9", "--batch-seqs", "4",
                              "--batch-prompt-tokens", "2048"])  # fmt: skip
    assert args.batch_seqs == 4 and args.batch_prompt_tokens == 2048
    assert args.threads == 1 and args.tidal_arg == ["dtype=float32"] and args.profile
    assert args.sampling == ["temperature=0.8", "top_p=0.9"]
    assert not args.llama and args.repetitions == KernelsConfig().repetitions


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}])
def test_tidal_side_runs_on_a_tiny_model(tmp_path: Path, monkeypatch, sampling: dict) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    cfg = KernelsConfig(threads=1, repetitions=2, prompt_tokens=24, decode_tokens=6,
                        batch_seqs=3, batch_prompt_tokens=8, tg_prompt_tokens=4,
                        profile_steps=3, sampling=sampling)  # fmt: skip
    seen: set[tuple[float, float]] = set()
    call = Sampler.__call__

    def spy(self, logits, rows):
        seen.update((r.params.temperature, r.params.top_p) for r in rows)
        time.sleep(0.002)  # so the profiles' sampler rows cannot read 0
        return call(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", spy)
    before = torch.get_num_threads()
    try:
        measures, settings, steps = run_tidal(
            cfg, model, {"kv_cache_bytes": 8 << 20, "block_size": 8}, profile=True
        )
    finally:
        torch.set_num_threads(before)
    assert set(measures) == {"pp24", "tg6", "b3-pp8-tg6"}
    for m in measures.values():
        assert len(m.samples_tok_s) == 2 and all(s > 0 for s in m.samples_tok_s)
    assert settings["threads"] == 1 and settings["num_layers"] == 4
    assert settings["config"]["cache"]["block_size"] == 8
    assert [(p.seqs, p.steps, p.num_layers) for p in steps] == [(1, 3, 4), (3, 3, 4)]
    for p in steps:
        # native_s, sampler_s and aten_s are differences of two timed runs, 0 below their noise
        assert p.native_s >= 0 and p.aten_s >= 0 and p.wall_s > 0
        assert p.sampler_s >= 0.002  # its region is timed apart: one call a step, each >= 2 ms
    # every request the measures and the profile ran sampled as asked
    assert seen == {(sampling.get("temperature", 0.0), sampling.get("top_p", 1.0))}


def test_a_moe_models_batched_sequences_share_a_prompt_as_batched_bench_s(tmp_path: Path) -> None:
    """llama-batched-bench feeds every sequence token 0: a mixture of experts routes them alike.
    On a MoE model tidal's batched measure gives its sequences one prompt too (like for like),
    adds the distinct-prompt figure, and the report says both."""
    from tidal.bench.synth import TwinSpec, synthesize
    from tidal.engine.llm import LLM

    spec = TwinSpec("deepseek-v2-lite", "q4_k_m", num_layers=2, tiny=True, tokenizer="bytes")
    model = synthesize(spec, tmp_path / "moe.gguf", quiet=True)
    cfg = KernelsConfig(threads=1, repetitions=1, prompt_tokens=16, decode_tokens=4,
                        batch_seqs=3, batch_prompt_tokens=8, tg_prompt_tokens=4)  # fmt: skip
    prompts: list[list[list[int]]] = []
    generate = LLM.generate

    def spy(self, *args, **kwargs):
        prompts.append(kwargs["prompt_token_ids"])
        return generate(self, *args, **kwargs)

    before = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LLM, "generate", spy)
            measures, settings, _ = run_tidal(cfg, model, {"kv_cache_bytes": 8 << 20}, False)
    finally:
        torch.set_num_threads(before)
    batches = [p for p in prompts if len(p) == 3]
    assert len(batches) == 3  # warm-up, the measure (one prompt), the distinct-prompt figure
    assert [len({tuple(p) for p in batch}) for batch in batches] == [1, 1, 3]
    assert settings["batched_same_prompt"] and settings["batched_distinct"]["samples_tok_s"]
    rows = [Row(name, m, Measure((1.0,))) for name, m in measures.items()]
    record = {**_record(rows), "tidal": {**_record(rows)["tidal"], **settings}}
    text = markdown_report(record, rows)
    assert "b3-pp8-tg4: a mixture of experts, so tidal's sequences share one prompt" in text
    assert "(distinct prompts, as real traffic routes: " in text
