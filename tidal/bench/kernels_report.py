"""The `tidal bench kernels` report: one row a measure (tidal beside each baseline) and the
Markdown that shows a run's record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tidal.bench.llama_bench import Measure
from tidal.bench.step_profile import StepProfile, profile_markdown


class Row(NamedTuple):
    """One measure, every system; None where a system did not run. `ik_variant` names the
    ik_llama.cpp variant whose figure `ik` is (the better of its default and -rtr runs)."""

    name: str
    tidal: Measure | None
    llama: Measure | None
    ik: Measure | None = None
    ik_variant: str | None = None

    @property
    def ratio(self) -> float | None:
        """tidal / llama.cpp of the medians: below 1 means tidal is slower."""
        return _ratio(self.tidal, self.llama)

    @property
    def ratio_ik(self) -> float | None:
        """tidal / ik_llama.cpp of the medians."""
        return _ratio(self.tidal, self.ik)

    def line(self) -> str:
        def one(m: Measure | None) -> str:
            return "-" if m is None else f"{_cell(m)} tok/s"

        text = f"{self.name:<9} tidal {one(self.tidal)} | llama.cpp {one(self.llama)}"
        text += f" | ratio {_ratio_cell(self.ratio)}"
        if self.ik is not None:
            text += f" | ik_llama.cpp {one(self.ik)} ({self.ik_variant})"
            text += f" | tidal/ik {_ratio_cell(self.ratio_ik)}"
        return text

    def record(self) -> dict[str, Any]:
        tidal, llama, ik = (
            m.record() if m is not None else None for m in (self.tidal, self.llama, self.ik)
        )
        return {"name": self.name, "tidal": tidal, "llama_cpp": llama, "ratio": self.ratio,
                "ik_llama_cpp": ik, "ik_variant": self.ik_variant, "ratio_ik": self.ratio_ik}  # fmt: skip


def _ratio(tidal: Measure | None, baseline: Measure | None) -> float | None:
    if tidal is None or baseline is None or baseline.median <= 0:
        return None
    return tidal.median / baseline.median


def markdown_report(
    record: dict[str, Any], rows: Sequence[Row], steps: Sequence[StepProfile] = ()
) -> str:
    """The record as Markdown: the machine and each system's settings, then one row a measure
    (ik_llama.cpp's columns where the record has an ik_llama.cpp side)."""
    flags = record["cpu_flags"]
    build = record["llama_cpp"].get("build", {})
    ik = record.get("ik_llama_cpp")
    tidal = record["tidal"]
    conf = tidal.get("config", {})
    picked = (("dtype", conf.get("hardware", {}).get("dtype")),
              ("quantization", conf.get("model", {}).get("quantization")),
              ("max_num_seqs", conf.get("scheduler", {}).get("max_num_seqs")),
              ("max_num_batched_tokens", conf.get("scheduler", {}).get("max_num_batched_tokens")))  # fmt: skip
    model_type = build.get("model_type") or (ik or {}).get("build", {}).get("model_type")
    model = f" ({model_type})" if model_type else ""
    sampling = record.get("workload", {}).get("sampling") or {}
    drawn = (f"samples every token ({', '.join(f'{k}={v!r}' for k, v in sampling.items())}; "
             "llama.cpp's benches do not sample)" if sampling else "greedy")  # fmt: skip
    ratios = "ratio = tidal / llama.cpp" + ("; tidal / ik = tidal / ik_llama.cpp" if ik else "")
    lines = [
        f"- CPU: {record['machine']['cpu_model']} ({record['machine']['cpu_count']} logical); "
        f"has {' '.join(f for f, v in flags.items() if v) or '-'}; "
        f"lacks {' '.join(f for f, v in flags.items() if not v) or '-'}",
        f"- threads: {record['threads']}; GGUF: `{record['gguf']}`{model}",
        f"- tidal: LLM({', '.join(f'{k}={v!r}' for k, v in tidal['args'].items()) or 'defaults'})"
        f": {', '.join(f'{k} {v}' for k, v in picked if v is not None)}; "
        f"torch {tidal.get('torch', '?')}; {drawn}",
        *kernels_line(tidal.get("kernels")),
        _baseline_line("llama.cpp", record["llama_cpp"]),
        *([_baseline_line("ik_llama.cpp", ik)] if ik else []),
        f"- {record['repetitions']} repetitions: median [min-max]; {ratios}",
        "",
    ]
    if ik:
        lines += ["| measure | tidal tok/s | llama.cpp tok/s | ik_llama.cpp tok/s "
                  "| tidal / llama.cpp | tidal / ik |", "|---|---|---|---|---|---|"]  # fmt: skip
    else:
        lines += [
            "| measure | tidal tok/s | llama.cpp tok/s | tidal / llama.cpp |",
            "|---|---|---|---|",
        ]
    for r in rows:
        cells = [_cell(r.tidal), _cell(r.llama)]
        if ik:
            cells.append(_cell(r.ik) + (f" ({r.ik_variant})" if r.ik is not None else ""))
        cells.append(_ratio_cell(r.ratio))
        if ik:
            cells.append(_ratio_cell(r.ratio_ik))
        lines.append(f"| {r.name} | {' | '.join(cells)} |")
    lines += [f"- {n}" for n in record["llama_cpp"].get("notes", [])]
    lines += [f"- ik_llama.cpp: {n}" for n in (ik or {}).get("notes", [])]
    if tidal.get("batched_same_prompt"):
        distinct = tidal.get("batched_distinct")
        seen = (f" (distinct prompts, as real traffic routes: {_cell(Measure(**distinct))} tok/s)"
                if distinct else "")  # fmt: skip
        lines.append(
            f"- {rows[2].name if len(rows) > 2 else 'batched'}: a mixture of experts, so tidal's "
            "sequences share one prompt, as llama-batched-bench's all read token 0 (they route "
            f"to the same experts){seen}"
        )
    text = "\n".join(lines) + "\n"
    for p in steps:  # each beside its measure's rate without the profiler
        m = rows[1 if p.seqs == 1 else 2].tidal if len(rows) > 2 else None
        rate = f"; without the profiler: {1e3 * p.seqs / m.median:.2f} ms per step" if m else ""
        text += "\n" + profile_markdown(p).replace(" layers:", f" layers{rate}:", 1)
    return text


def _cell(m: Measure | None) -> str:
    if m is None:
        return "-"
    lo, hi = m.spread
    return f"{m.median:.1f} [{lo:.1f}-{hi:.1f}]"


def _ratio_cell(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _baseline_line(name: str, info: dict[str, Any]) -> str:
    """The report's line on one baseline: its build, where its binaries are, how they were built
    and from what, and (with several variants) how its figures were picked."""
    build = info.get("build", {})
    if not build:
        return f"- {name}: not run"
    text = (f"- {name}: build {build.get('build_number', '?')} (commit "
            f"{build.get('build_commit', '?')}), {build.get('backends', '?')}")  # fmt: skip
    if info.get("bin_dir"):
        text += f"; binaries from `{info['bin_dir']}`"
        if flavor := info.get("flavor"):
            text += f", built {flavor}"
        if built_from := info.get("built_from"):
            text += f" from {built_from}"
    variants = list(info.get("variants", {}))
    if len(variants) > 1:
        text += f"; each figure the better median of its runs {' and '.join(variants)}"
    return text


def kernels_line(kernels: dict[str, Any] | None) -> list[str]:
    """The report's line on tidal's kernel paths and the settings that lowered them ([] when the
    record has none)."""
    if not kernels:
        return []
    paths = ", ".join(f"{k} {v or 'not built'}" for k, v in kernels["paths"].items())
    caps = ", ".join(f"{k}={v}" for k, v in kernels["caps"].items())
    return [f"- tidal kernels: {paths}" + (f" (lowered: {caps})" if caps else "")]
