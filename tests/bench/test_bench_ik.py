"""`tidal bench kernels` with ik_llama.cpp beside llama.cpp: its outputs parse, its two runs
(default and -rtr) keep the better figure per measure, and its binaries come from its own bin dir."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.bench.test_bench_kernels import (
    BATCHED_JSONL,
    IK_BATCHED,
    IK_BENCH,
    LLAMA_BENCH_JSON,
    _record,
    _tool,
)
from tidal.bench.baselines import IK_LLAMA_CPP, LLAMA_CPP
from tidal.bench.cli import add_parser
from tidal.bench.kernels import (
    KernelsConfig,
    baseline_list,
)
from tidal.bench.kernels_report import Row, markdown_report
from tidal.bench.llama_bench import (
    Measure,
    llama_commands,
    parse_batched_bench,
    parse_llama_bench,
    run_baseline,
)


def test_parse_ik_llama_bench_reads_its_tests_and_names_its_backends() -> None:
    measures, build = parse_llama_bench("llama_model_loader: ...\n" + IK_BENCH["default"])
    assert set(measures) == {"pp64", "tg16"}
    assert measures["pp64"].samples_tok_s == (910.699, 919.954)
    assert measures["tg16"].samples_tok_s == (44.1669, 40.0272)
    assert build["backends"] == "CPU"  # every backend flag false
    assert build["model_type"] == "gemma3 ?B Q4_K - Medium" and build["n_threads"] == 2
    assert build["repack"] is False and build["mla_attn"] == 3 and build["flash_attn"] is True
    assert build["build_commit"] == "unknown"  # built from an export: bin/COMMIT names it
    measures, build = parse_llama_bench(IK_BENCH["-rtr 1"])
    assert build["repack"] is True and measures["pp64"].samples_tok_s == (791.753, 774.864)


@pytest.mark.parametrize("label", list(IK_BATCHED))
def test_parse_ik_batched_bench_reads_its_table(label: str) -> None:
    rows = parse_batched_bench(IK_BATCHED[label])
    assert len(rows) == 1
    assert (rows[0]["pp"], rows[0]["tg"], rows[0]["pl"], rows[0]["n_kv"]) == (4, 16, 8, 160)
    assert rows[0]["speed_tg"] == {"default": 178.03, "-rtr 1": 188.02}[label]


def test_ik_commands_add_each_variants_flags_and_ask_for_no_jsonl() -> None:
    cfg = KernelsConfig(threads=2, repetitions=3)
    gguf = Path("m.gguf")
    default, rtr = IK_LLAMA_CPP.variants
    assert (default.label, rtr.label) == ("default", "-rtr 1")
    bench, batched = llama_commands(cfg, "b", "bb", gguf, IK_LLAMA_CPP, default)
    assert "-rtr" not in bench + batched and "--output-format" not in batched
    bench_rtr, batched_rtr = llama_commands(cfg, "b", "bb", gguf, IK_LLAMA_CPP, rtr)
    assert bench_rtr == [*bench, "-rtr", "1"]  # llama-bench's -rtr takes 0|1
    assert batched_rtr == [*batched, "-rtr"]  # common's -rtr is a flag
    _, llama_batched = llama_commands(cfg, "b", "bb", gguf)
    assert llama_batched == [*batched, "--output-format", "jsonl"]


def _fake_ik(bin_dir: Path, n_gen: int = 16) -> None:
    """ik_llama.cpp's two benches as shell scripts printing the recorded outputs, those of -rtr
    when the command has it (tg128 in place of tg16 with n_gen=128)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for label, name in (("default", "default"), ("-rtr 1", "rtr")):
        bench = IK_BENCH[label].replace('"n_gen": 16', f'"n_gen": {n_gen}')
        (bin_dir / f"bench.{name}.json").write_text(bench)
        (bin_dir / f"batched.{name}.txt").write_text(IK_BATCHED[label])
    for tool, out in (("llama-bench", "bench.{}.json"), ("llama-batched-bench", "batched.{}.txt")):
        rtr, default = (f"{bin_dir}/{out.format(name)}" for name in ("rtr", "default"))
        # as ik's do: the log into ./llama.log, the batched table on stderr
        to = ">&2" if tool == "llama-batched-bench" else ""
        _tool(bin_dir / tool, f'echo log > llama.log; case "$*" in *-rtr*) cat {rtr} {to};; '
                              f'*) cat {default} {to};; esac')  # fmt: skip


def test_ik_runs_with_and_without_rtr_and_keeps_the_better_per_measure(
    tmp_path: Path, monkeypatch
) -> None:
    bin_dir = tmp_path / "ik"
    _fake_ik(bin_dir)
    (bin_dir / "COMMIT").write_text("8337e4cd3861406fc04e0854b1409cd1b027fbc9\n")
    (bin_dir / "FLAVOR").write_text("native\n")
    monkeypatch.chdir(tmp_path)
    cfg = KernelsConfig(repetitions=2, prompt_tokens=64, decode_tokens=16, batch_seqs=8,
                        batch_prompt_tokens=4)  # fmt: skip
    measures, info = run_baseline(cfg, Path("m.gguf"), IK_LLAMA_CPP, Path("ik"))
    assert not (tmp_path / "llama.log").exists()  # the tools ran in a scratch directory
    assert cfg.names() == ("pp64", "tg16", "b8-pp4-tg16")
    # recorded: -rtr slower prefill here, faster single-sequence and batched decode
    assert info["chosen"] == {"pp64": "default", "tg16": "-rtr 1", "b8-pp4-tg16": "-rtr 1"}
    assert measures["pp64"].samples_tok_s == (910.699, 919.954)
    assert measures["tg16"].samples_tok_s == (48.2479, 51.0875)
    assert measures["b8-pp4-tg16"].samples_tok_s == (188.02, 188.02)  # once per repetition
    assert info["variants"]["default"]["b8-pp4-tg16"]["median_tok_s"] == 178.03
    assert info["variants"]["-rtr 1"]["pp64"]["samples_tok_s"] == [791.753, 774.864]
    assert info["built_from"].startswith("8337e4cd") and info["flavor"] == "native"
    assert info["build"]["backends"] == "CPU" and info["notes"] == []
    commands = info["commands"]
    assert len(commands) == 4 and commands[2].endswith("-o json -rtr 1")
    assert commands[3].endswith("-npl 8 -rtr") and "jsonl" not in commands[1]
    assert commands[0].startswith(f"{tmp_path}/ik/llama-bench -m {tmp_path}/m.gguf ")
    _tool(bin_dir / "llama-bench",
          f'case "$*" in *-rtr*) exit 1;; *) cat {bin_dir}/bench.default.json;; esac')  # fmt: skip
    measures, info = run_baseline(cfg, Path("m.gguf"), IK_LLAMA_CPP, bin_dir)
    assert info["notes"] == ["-rtr 1: llama-bench exited with 1: "]
    assert info["chosen"]["tg16"] == "default" and info["chosen"]["b8-pp4-tg16"] == "-rtr 1"


def test_ik_binaries_come_from_its_own_bin_dir_never_path(tmp_path: Path, monkeypatch) -> None:
    """Both forks name their binaries alike: llama.cpp's on PATH must not stand in for ik's."""
    on_path = tmp_path / "path"
    on_path.mkdir()
    for name in ("llama-bench", "llama-batched-bench", "llama-server"):
        _tool(on_path / name, "exit 0")
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("IK_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    measures, info = run_baseline(
        KernelsConfig(), tmp_path / "m.gguf", IK_LLAMA_CPP, tmp_path / "ik"
    )
    assert measures == {}
    assert "scripts/build_ik_llama.sh" in info["notes"][0] and "--ik-bin-dir" in info["notes"][0]
    assert IK_LLAMA_CPP.find_server() is None
    assert (
        IK_LLAMA_CPP.server_path() == tmp_path / "cache" / "ik_llama.cpp" / "bin" / "llama-server"
    )
    assert LLAMA_CPP.find(tmp_path / "nowhere", "llama-bench") == str(on_path / "llama-bench")
    assert LLAMA_CPP.find_server() == str(on_path / "llama-server")
    monkeypatch.setenv("IK_LLAMA_SERVER", str(on_path / "llama-server"))
    assert IK_LLAMA_CPP.bin_dir() == on_path and IK_LLAMA_CPP.bin_dir("/x") == Path("/x")


def test_default_baselines_are_those_built(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("IK_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    # none built: llama.cpp, whose note then says how to build it
    assert baseline_list(None, {}) == [LLAMA_CPP]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _tool(elsewhere / "llama-bench", "")
    assert baseline_list(None, {"ik_llama.cpp": str(elsewhere)}) == [IK_LLAMA_CPP]
    (tmp_path / "ik_llama.cpp" / "bin").mkdir(parents=True)
    _tool(tmp_path / "ik_llama.cpp" / "bin" / "llama-bench", "")
    assert baseline_list(None, {}) == [IK_LLAMA_CPP]
    (tmp_path / "llama.cpp" / "bin").mkdir(parents=True)
    _tool(tmp_path / "llama.cpp" / "bin" / "llama-bench", "")
    assert baseline_list(None, {}) == [LLAMA_CPP, IK_LLAMA_CPP]
    assert baseline_list("ik_llama.cpp, llama.cpp", {}) == [IK_LLAMA_CPP, LLAMA_CPP]
    assert baseline_list("llama.cpp,llama.cpp", {}) == [LLAMA_CPP]
    for bad in ("vllm", ",", "llama.cpp,ik"):
        with pytest.raises(ValueError, match=r"--baselines=.* is invalid: expected names from"):
            baseline_list(bad, {})


def test_row_with_ik_adds_its_figure_ratio_and_variant() -> None:
    row = Row("tg128", Measure((35.0,)), Measure((70.0,)), Measure((50.0, 48.0)), "-rtr 1")
    assert row.ratio == pytest.approx(0.5) and row.ratio_ik == pytest.approx(35.0 / 49.0)
    line = row.line()
    assert "| ratio 0.50 | ik_llama.cpp" in line and "(-rtr 1)" in line
    assert line.endswith("tidal/ik 0.71")
    record = row.record()
    assert record["ratio"] == pytest.approx(0.5) and record["llama_cpp"]["median_tok_s"] == 70.0
    assert record["ik_llama_cpp"]["samples_tok_s"] == [50.0, 48.0]
    assert record["ik_variant"] == "-rtr 1" and record["ratio_ik"] == pytest.approx(35.0 / 49.0)
    plain = Row("tg128", Measure((35.0,)), None).record()
    assert plain["ik_llama_cpp"] is None and plain["ratio_ik"] is None


def test_markdown_report_with_ik_adds_its_columns_build_and_notes() -> None:
    rows = [
        Row("pp512", Measure((300.0,)), Measure((746.0,)), Measure((900.0, 1000.0)), "-rtr 1"),
        Row("tg128", Measure((35.0,)), None, Measure((40.0,)), "default"),
        Row("b32-tg128", None, Measure((235.0,))),
    ]
    record = _record(rows)
    record["ik_llama_cpp"] = {
        "build": {"build_number": 1, "build_commit": "unknown", "backends": "CPU"},
        "bin_dir": "/ik", "flavor": "native", "built_from": "8337e4c",
        "variants": {"default": {}, "-rtr 1": {}}, "notes": ["llama-bench exited with 1: x"],
    }  # fmt: skip
    text = markdown_report(record, rows)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == (
        "| measure | tidal tok/s | llama.cpp tok/s | ik_llama.cpp tok/s | tidal / llama.cpp "
        "| tidal / ik |"
    )
    assert table[1] == (
        "| pp512 | 300.0 [300.0-300.0] | 746.0 [746.0-746.0] | 950.0 [900.0-1000.0] (-rtr 1) "
        "| 0.40 | 0.32 |"
    )
    assert table[2] == "| tg128 | 35.0 [35.0-35.0] | - | 40.0 [40.0-40.0] (default) | - | 0.88 |"
    assert table[3] == "| b32-tg128 | - | 235.0 [235.0-235.0] | - | - | - |"
    assert (
        "- ik_llama.cpp: build 1 (commit unknown), CPU; binaries from `/ik`, built native from "
        "8337e4c; each figure the better median of its runs default and -rtr 1" in text
    )
    assert "- llama.cpp: build 1 (commit 0c1e570), CPU" in text
    assert "ratio = tidal / llama.cpp; tidal / ik = tidal / ik_llama.cpp" in text
    assert "- ik_llama.cpp: llama-bench exited with 1: x" in text and "- a note" in text
    record["llama_cpp"] = {"notes": ["not run (--baselines)"]}
    text = markdown_report(record, rows)
    assert "- llama.cpp: not run\n" in text and "- not run (--baselines)" in text
    assert "(gemma3)" not in text  # the model type came from llama.cpp's build facts


def test_kernels_run_reports_both_baselines(tmp_path: Path, monkeypatch) -> None:
    """`tidal bench kernels --baselines llama.cpp,ik_llama.cpp` end to end with stand-in benches
    and a stand-in tidal: one record, one table, both baselines' columns."""
    import json

    from tidal.bench import kernels

    llama_dir, ik_dir = tmp_path / "llama", tmp_path / "ik"
    llama_dir.mkdir()
    (llama_dir / "bench.json").write_text(LLAMA_BENCH_JSON.replace('"n_gen": 16', '"n_gen": 128'))
    _tool(llama_dir / "llama-bench", f"cat {llama_dir}/bench.json")
    _tool(llama_dir / "llama-batched-bench", f"cat <<'X'\n{BATCHED_JSONL}X")
    _fake_ik(ik_dir, n_gen=128)  # tg128: the default decode measure's

    def fake_tidal(cfg, model, tidal_args, profile):
        ms = {n: Measure((v,)) for n, v in zip(cfg.names(), (457.0, 30.0, 94.0))}
        return ms, {"args": tidal_args, "torch": "2.x", "config": {}}, ()

    monkeypatch.setattr(kernels, "run_tidal", fake_tidal)
    parser = argparse.ArgumentParser(prog="tidal")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "kernels", "--model", str(tmp_path / "m.gguf"),
                              "--prompt-tokens", "64", "--repetitions", "1",
                              "--baselines", "llama.cpp,ik_llama.cpp",
                              "--llama-bin-dir", str(llama_dir), "--ik-bin-dir", str(ik_dir),
                              "--json", str(tmp_path / "k.json"),
                              "--markdown", str(tmp_path / "k.md")])  # fmt: skip
    assert args.func(args) == 0
    record = json.loads((tmp_path / "k.json").read_text())
    assert record["llama_cpp"]["chosen"] == {
        "pp64": "default", "tg128": "default", "b32-tg128": "default"}  # fmt: skip
    assert record["ik_llama_cpp"]["chosen"] == {
        "pp64": "default", "tg128": "-rtr 1", "b32-tg128": "-rtr 1"}  # fmt: skip
    by_name = {m["name"]: m for m in record["measures"]}
    pp, b32 = by_name["pp64"], by_name["b32-tg128"]
    assert pp["llama_cpp"]["samples_tok_s"] == [15.6405, 23.749] and pp["ik_variant"] == "default"
    assert pp["ik_llama_cpp"]["samples_tok_s"] == [910.699, 919.954]  # as recorded, -r 2
    assert pp["ratio_ik"] == pytest.approx(457.0 / 915.3265)
    assert b32["llama_cpp"]["median_tok_s"] == pytest.approx(5.1)
    assert b32["ik_llama_cpp"]["median_tok_s"] == 188.02 and b32["ik_variant"] == "-rtr 1"
    table = (tmp_path / "k.md").read_text()
    assert [line for line in table.splitlines() if line.startswith("| ")][1:] == [
        "| pp64 | 457.0 [457.0-457.0] | 19.7 [15.6-23.7] | 915.3 [910.7-920.0] (default) | 23.20 | 0.50 |",
        "| tg128 | 30.0 [30.0-30.0] | 2.9 [0.6-5.2] | 49.7 [48.2-51.1] (-rtr 1) | 10.45 | 0.60 |",
        "| b32-tg128 | 94.0 [94.0-94.0] | 5.1 [5.1-5.1] | 188.0 [188.0-188.0] (-rtr 1) | 18.43 | 0.50 |",
    ]  # fmt: skip
    assert "- ik_llama.cpp: build 0 (commit unknown), CPU; binaries from" in table


def test_baseline_options_parse() -> None:
    parser = argparse.ArgumentParser(prog="tidal")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "kernels", "--baselines", "llama.cpp,ik_llama.cpp",
                              "--ik-bin-dir", "/ik/bin"])  # fmt: skip
    assert args.baselines == "llama.cpp,ik_llama.cpp" and args.ik_bin_dir == "/ik/bin"
    defaults = parser.parse_args(["bench", "kernels"])
    assert defaults.baselines is None and defaults.ik_bin_dir is None and defaults.llama
