"""Per-step decode profiles for `tidal bench kernels --profile`: native kernels, the sampler, aten and the rest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Decode of `seqs` sequences together, per step: wall time split into native kernels, the
    sampler, aten ops and the rest."""

    steps: int
    num_layers: int
    wall_s: float
    native_s: float  # tidal::* regions but the sampler's, whole (what runs inside them counts)
    aten_s: float  # self time of aten::* ops outside tidal::* regions
    native_by_name: tuple[tuple[str, float], ...] = ()  # native_s per region name, largest first
    seqs: int = 1
    sampler_s: float = 0.0  # the sampler's region (SAMPLER_REGION), whole

    @property
    def other_s(self) -> float:
        return self.wall_s - self.native_s - self.sampler_s - self.aten_s


def split_events(events: Iterable[Any]) -> tuple[dict[str, float], float]:
    """({region: native_us}, aten_us) of torch.profiler FunctionEvents: the whole time of each
    outermost `tidal::*` region by name, and the self time of each `aten::*` op not inside one."""
    native_us: dict[str, float] = {}
    aten_us = 0.0
    for e in events:
        parent, inside = e.cpu_parent, False
        while parent is not None and not inside:
            inside, parent = parent.name.startswith("tidal::"), parent.cpu_parent
        if inside:
            continue
        if e.name.startswith("tidal::"):
            native_us[e.name] = native_us.get(e.name, 0.0) + e.cpu_time_total
        elif e.name.startswith("aten::"):
            aten_us += e.self_cpu_time_total
    return native_us, aten_us


def _profiled(llm, prompts: list[list[int]], params: Any) -> tuple[float, dict[str, float], float]:
    """(decode window: first token of any -> last token of any, seconds; native region totals;
    aten total)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    first = min(o.metrics.first_token_time_s for o in outs)
    last = max(o.metrics.last_token_time_s or o.metrics.finished_time_s for o in outs)
    native_us, aten_us = split_events(prof.events())
    return last - first, {k: v / 1e6 for k, v in native_us.items()}, aten_us / 1e6


def profile_decode(
    llm, prompts: list[list[int]], steps: int, num_layers: int, params: Callable[[int], Any]
) -> StepProfile:
    """Per decode step of the prompts' sequences together: the wall time of the steps of a
    generate() of 1 + steps tokens each (first token of any to last token of any, so no
    prefill), and its profiled regions minus those of a generate() of 1 token each on the same
    prompts (long ones prefilled into the prefix cache beforehand are hits in both runs, short
    ones full prefills in both, so the difference is the decode steps either way). params(n):
    the requests' SamplingParams for n tokens. The profiler's own cost per op lands in 'other'."""
    from tidal.layers.sampler import SAMPLER_REGION

    _, native_1, aten_1 = _profiled(llm, prompts, params(1))
    wall_n, native_n, aten_n = _profiled(llm, prompts, params(1 + steps))
    by_name = {k: max(0.0, (native_n.get(k, 0.0) - native_1.get(k, 0.0)) / steps) for k in native_n}
    sampler_s = by_name.pop(SAMPLER_REGION, 0.0)
    ranked = tuple(sorted(by_name.items(), key=lambda kv: -kv[1]))
    # Differences of two timed runs: where a step's share of a region or of aten is below the
    # runs' noise (a tiny model's microsecond kernels) it can come out negative; that reads as 0.
    aten_s = max(0.0, (aten_n - aten_1) / steps)
    return StepProfile(steps, num_layers, wall_n / steps, sum(by_name.values()), aten_s,
                       ranked, len(prompts), sampler_s)  # fmt: skip


def profile_markdown(p: StepProfile) -> str:
    what = "Single-stream decode" if p.seqs == 1 else f"{p.seqs} sequences decoding together"
    lines = [
        f"{what}, {p.steps} steps under torch.profiler, {p.num_layers} layers:", "",
        "| part | ms per step | ms per layer | share |", "|---|---|---|---|",
    ]  # fmt: skip
    parts = (("tidal native kernels (`tidal::*`)", p.native_s),
             *((f"- `{name}`", s) for name, s in p.native_by_name),
             ("sampler (its kernels and Python)", p.sampler_s),
             ("torch aten ops (self time)", p.aten_s),
             ("other (Python, scheduler, output, profiler)", p.other_s),
             ("wall", p.wall_s))  # fmt: skip
    for name, s in parts:
        share = 100 * s / p.wall_s if p.wall_s > 0 else 0.0
        lines.append(f"| {name} | {1e3 * s:.2f} | {1e3 * s / p.num_layers:.3f} | {share:.0f}% |")
    return "\n".join(lines) + "\n"
