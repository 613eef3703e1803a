"""llama-bench and llama-batched-bench of the llama.cpp-family baselines (llama.cpp, ik_llama.cpp):
running and parsing them for `tidal bench kernels`, and `Measure`, one system's figure over
repetitions."""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.bench.baselines import LLAMA_CPP, Baseline, Variant, build_flavor

if TYPE_CHECKING:
    from tidal.bench.kernels import KernelsConfig


@dataclass(frozen=True, slots=True)
class Measure:
    """One system's figure over its repetitions, in tokens/s."""

    samples_tok_s: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples_tok_s)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.samples_tok_s), max(self.samples_tok_s)

    @property
    def stddev(self) -> float | None:
        return statistics.stdev(self.samples_tok_s) if len(self.samples_tok_s) > 1 else None

    def record(self) -> dict[str, Any]:
        lo, hi = self.spread
        return {"median_tok_s": self.median, "min_tok_s": lo, "max_tok_s": hi,
                "stddev_tok_s": self.stddev, "samples_tok_s": list(self.samples_tok_s)}  # fmt: skip


def describe_exit(returncode: int, baseline: Baseline | None = None) -> str:
    """A process's exit status in words: "exited with N", or the signal that killed it; for a
    baseline's process, what its SIGILL means."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"was killed by signal {-returncode}"
    text = f"was killed by {name}"
    if name == "SIGILL" and baseline is not None:
        text += f" ({baseline.sigill_hint})"
    return text


def parse_llama_bench(text: str) -> tuple[dict[str, Measure], dict[str, Any]]:
    """`llama-bench -o json` of llama.cpp or ik_llama.cpp -> ({"pp512": ..., "tg128": ...},
    build/model facts)."""
    tests: list[dict[str, Any]] | None = None
    for m in re.finditer(r"\[", text):  # the first '[' that opens a list of test objects
        try:
            found, _ = json.JSONDecoder().raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        if isinstance(found, list) and found and all(isinstance(t, dict) for t in found):
            tests = found
            break
    if tests is None:
        raise ValueError("llama-bench output holds no JSON array of tests: expected `-o json`")
    measures: dict[str, Measure] = {}
    for t in tests:
        n_prompt, n_gen = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0))
        name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else None
        if name is None:  # a -pg test (prompt then generation): not one of ours
            continue
        samples = t.get("samples_ts") or [t["avg_ts"]]
        measures[name] = Measure(tuple(float(s) for s in samples))
    first = tests[0] if tests else {}
    keys = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size",
            "model_n_params", "n_batch", "n_ubatch", "n_threads", "type_k", "type_v",
            "flash_attn", "mla_attn", "repack")  # fmt: skip
    facts = {k: first[k] for k in keys if k in first}
    if "backends" not in first and "blas" in first:
        # ik_llama.cpp's llama-bench names no backends: it has one flag per backend instead
        on = [name for name in _IK_BACKEND_FLAGS if first.get(name) is True]
        facts["backends"] = ",".join(on) or "CPU"
    return measures, facts


# ik_llama.cpp's llama-bench fields, one per backend (all false: the CPU alone)
_IK_BACKEND_FLAGS = ("cuda", "vulkan", "metal", "sycl", "rpc", "gpu_blas", "blas")


_TABLE_ROW = re.compile(r"^\|\s*\d+\s*\|(\s*[\d.]+\s*\|){9}\s*$")
_COLUMNS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """llama-batched-bench's rows (its jsonl lines, or its Markdown table) as dicts with pp, tg,
    pl, t_tg, speed_tg (S_TG t/s), ..."""
    rows: list[dict[str, float]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append({k: float(v) for k, v in json.loads(line).items()})
        elif _TABLE_ROW.match(line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append({k: float(v) for k, v in zip(_COLUMNS, cells)})
    return rows


def llama_commands(
    cfg: KernelsConfig,
    bench: str,
    batched: str,
    gguf: Path,
    baseline: Baseline = LLAMA_CPP,
    variant: Variant | None = None,
) -> tuple[list[str], list[str]]:
    """The llama-bench and llama-batched-bench commands of one baseline's variant (its first,
    the defaults, unless given)."""
    variant = variant or baseline.variants[0]
    pl, npp, ntg = cfg.batch_seqs, cfg.batch_prompt_tokens, cfg.decode_tokens
    bench_cmd = [bench, "-m", str(gguf), "-t", str(cfg.threads), "-p", str(cfg.prompt_tokens),
                 "-n", str(ntg), "-r", str(cfg.repetitions), "-o", "json"]  # fmt: skip
    # NOTE: llama-batched-bench silently skips a case whose pl * (pp + tg) exceeds -c.
    batched_cmd = [batched, "-m", str(gguf), "-t", str(cfg.threads), "-c", str(pl * (npp + ntg)),
                   "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg),
                   "-npl", str(pl)]  # fmt: skip
    if baseline.batched_jsonl:
        batched_cmd += ["--output-format", "jsonl"]
    return bench_cmd + list(variant.bench_args), batched_cmd + list(variant.batched_args)


def run_baseline(
    cfg: KernelsConfig, gguf: Path, baseline: Baseline, bin_dir: Path
) -> tuple[dict[str, Measure], dict[str, Any]]:
    """A baseline's measures and facts. Each of its variants runs; a measure's figure is the
    variant with the higher median (info["chosen"] names it). A missing binary or a failed run
    leaves a note instead."""
    # absolute paths: the tools run in a scratch directory (_run_tool)
    bench = baseline.find(bin_dir.absolute(), "llama-bench")
    batched = baseline.find(bin_dir.absolute(), "llama-batched-bench")
    gguf = gguf.absolute()
    info: dict[str, Any] = {"bin_dir": str(bin_dir), "flavor": build_flavor(bin_dir),
                            "built_from": baseline.stamp(bin_dir), "notes": []}  # fmt: skip
    if bench is None or batched is None:
        info["notes"].append(
            f"llama-bench/llama-batched-bench not found in {bin_dir}: build them with "
            f"`nice -n 19 bash {baseline.build_script} llama-bench llama-batched-bench` "
            f"(or pass {baseline.bin_dir_flag})"
        )
        print(f"{baseline.name}: {info['notes'][-1]}", file=sys.stderr)
        return {}, info
    info["commands"], info["variants"] = [], {}
    found: dict[str, dict[str, Measure]] = {}
    for variant in baseline.variants:
        bench_cmd, batched_cmd = llama_commands(cfg, bench, batched, gguf, baseline, variant)
        info["commands"] += [" ".join(bench_cmd), " ".join(batched_cmd)]
        num_notes = len(info["notes"])
        found[variant.label] = _run_variant(cfg, bench_cmd, batched_cmd, baseline, info)
        if len(baseline.variants) > 1:  # say which run a note is about
            info["notes"][num_notes:] = [f"{variant.label}: {n}" for n in info["notes"][num_notes:]]
        info["variants"][variant.label] = {
            name: m.record() for name, m in found[variant.label].items()
        }
    measures: dict[str, Measure] = {}
    info["chosen"] = {}
    for name in cfg.names():
        runs = [(label, ms[name]) for label, ms in found.items() if name in ms]
        if runs:
            label, measures[name] = max(runs, key=lambda run: run[1].median)
            info["chosen"][name] = label
    return measures, info


def _run_variant(
    cfg: KernelsConfig,
    bench_cmd: list[str],
    batched_cmd: list[str],
    baseline: Baseline,
    info: dict[str, Any],
) -> dict[str, Measure]:
    measures: dict[str, Measure] = {}
    out = _run_tool(bench_cmd, cfg.llama_timeout_s, baseline, info)
    if out is not None:
        found, build = parse_llama_bench(out[0])  # the JSON is on stdout, the load log on stderr
        info.setdefault("build", build)
        measures.update({k: v for k, v in found.items() if k in cfg.names()})
    # llama-batched-bench runs each case once (after its own 16-token warm-up): run it N times.
    speeds = []
    for _ in range(cfg.repetitions):
        out = _run_tool(batched_cmd, cfg.llama_timeout_s, baseline, info)
        # Its table goes through llama.cpp's log (stdout or stderr, by version): read both.
        rows = parse_batched_bench("\n".join(out)) if out is not None else []
        if not rows:
            if out is not None:
                info["notes"].append("llama-batched-bench printed no result row")
            break
        speeds.append(rows[0]["speed_tg"])
    if speeds:
        measures[cfg.names()[2]] = Measure(tuple(speeds))
    return measures


def _run_tool(
    cmd: list[str], timeout_s: float, baseline: Baseline, info: dict[str, Any]
) -> tuple[str, str] | None:
    """(stdout, stderr) of a successful run; None after adding a note on why it failed."""
    print(f"{baseline.name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        # NOTE: in a scratch directory: ik_llama.cpp's tools write their log (llama.log) into
        # the working directory (its --log-disable would silence llama-batched-bench's table).
        with tempfile.TemporaryDirectory(prefix="tidal-bench-") as scratch:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, cwd=scratch
            )
    except (OSError, subprocess.TimeoutExpired) as e:
        info["notes"].append(f"{Path(cmd[0]).name} failed: {e}")
        return None
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        info["notes"].append(
            f"{Path(cmd[0]).name} {describe_exit(proc.returncode, baseline)}: {tail}"
        )
        return None
    return proc.stdout, proc.stderr
