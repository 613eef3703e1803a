"""Kernels: tidal's engine against llama-bench and llama-batched-bench on one GGUF and thread count.

    tidal bench kernels --threads 2 --repetitions 3 --json k.json --markdown k.md --profile

Three measures, each side by side with the baselines' figures for it (llama.cpp's, and
ik_llama.cpp's where `--baselines` names it or it is built: the better of its default run and
its `-rtr 1` run, per measure), in tokens/s:

- pp512: one prompt of 512 tokens (BOS + seeded random ids, as llama-bench draws them), timed to
  its first token (tidal: max_tokens=1, arrival -> first token; llama-bench: `-p 512`).
- tg128: one sequence decoding 128 tokens after its prefill (tidal: 129 greedy tokens with
  ignore_eos, timed first token -> last token; llama-bench: `-n 128`).
- b32-tg128: 32 sequences decoding 128 tokens each together after a short prompt (tidal: total
  decode tokens / (last token of any - first token of any); llama-batched-bench: S_TG).
  `--batch-seqs` and `--batch-prompt-tokens` change its shape (b4-pp2048-tg128: decode over long
  chats); prompts past one step's token budget are prefilled first, so that the timed run's
  first tokens all come from one step (prefix-cache hits) and the window holds decode alone.
  llama-batched-bench's sequences all read token 0; a mixture of experts routes such sequences
  to the same experts, so on MoE models tidal's sequences share one prompt too, and the
  distinct-prompt figure (what real traffic reads) is reported beside it.

tidal runs through the public API only (`tidal.LLM`), with its defaults unless `--tidal-arg k=v`,
and decodes greedily unless `--sampling k=v` (SamplingParams fields, e.g. temperature=0.8): llama.cpp's
benches decode without sampling, so a sampled run charges tidal for its sampler and them for none.
Each prompt is new (seed + repetition), so the prefix cache never turns a timed prefill into a
hit (the long batched prompts' prefill-first above is the one deliberate hit).
`--profile` splits decode steps, of one sequence and of the batched measure's sequences together,
into tidal's native kernels (`tidal::*` regions), the sampler (its kernels and Python), torch's
aten ops (self time) and the rest (Python, scheduler, output).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tidal.bench.baselines import BASELINES, IK_LLAMA_CPP, LLAMA_CPP, Baseline
from tidal.bench.kernels_report import Row, markdown_report
from tidal.bench.llama_bench import Measure, run_baseline
from tidal.bench.step_profile import StepProfile, profile_decode

# The CPU features that decide which matmul paths exist (tidal's kernels and ggml-cpu alike).
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
                  "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


# 32 x 16 fit one prefill step of tidal's default token budget
DEFAULT_BATCH_PROMPT_TOKENS = 16


@dataclass(frozen=True, slots=True)
class KernelsConfig:
    """What one invocation measures; the CLI's defaults read from here."""

    threads: int = 2
    repetitions: int = 3
    prompt_tokens: int = 512  # pp
    decode_tokens: int = 128  # tg, per sequence
    batch_seqs: int = 32
    batch_prompt_tokens: int = DEFAULT_BATCH_PROMPT_TOKENS
    tg_prompt_tokens: int = 4
    profile_steps: int = 32
    seed: int = 0
    llama_timeout_s: float = 1800.0
    # SamplingParams fields for tidal's requests (empty: greedy); see parse_sampling_args
    sampling: dict[str, Any] = field(default_factory=dict)

    def names(self) -> tuple[str, str, str]:
        """The three measures' names, llama-bench's style: pp512, tg128, b32-tg128 (b4-pp2048-tg128
        where the batched prompts are not the default 16 tokens)."""
        n, npp = self.decode_tokens, self.batch_prompt_tokens
        ctx = "" if npp == DEFAULT_BATCH_PROMPT_TOKENS else f"-pp{npp}"
        return f"pp{self.prompt_tokens}", f"tg{n}", f"b{self.batch_seqs}{ctx}-tg{n}"


# --------------------------------------------------------------------------------------------
# tidal: the public API only


def _key_values(pairs: Iterable[str], flag: str, example: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{flag} {pair!r} is invalid: expected KEY=VALUE, e.g. {example}")
        out[key.strip()] = _value(text.strip())
    return out


def parse_tidal_args(pairs: Iterable[str]) -> dict[str, Any]:
    """["quantization=int8", "max_num_seqs=8", "enable_prefix_caching=false"] -> LLM kwargs."""
    out = _key_values(pairs, "--tidal-arg", "dtype=bfloat16")
    if "threads" in out:
        raise ValueError("--tidal-arg threads=... is invalid: use --threads (both systems get it)")
    return out


# what every measure's requests must have: exactly the measure's tokens each
_BENCH_SETS = ("max_tokens", "ignore_eos", "n", "min_tokens", "stop", "stop_token_ids")


def parse_sampling_args(pairs: Iterable[str]) -> dict[str, Any]:
    """["temperature=0.8", "top_p=0.95"] -> SamplingParams fields for every request tidal runs,
    checked as SamplingParams checks a request's."""
    from tidal import SamplingParams

    out = _key_values(pairs, "--sampling", "temperature=0.8")
    known = {f.name for f in fields(SamplingParams)}
    for key in out:
        if key not in known:
            raise ValueError(f"--sampling {key}=... is invalid: SamplingParams has no {key!r}")
        if key in _BENCH_SETS:
            raise ValueError(
                f"--sampling {key}=... is invalid: the bench sets {key} itself (every request "
                "decodes exactly the measure's tokens)"
            )
    _params(1, out)
    return out


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _params(max_tokens: int, sampling: dict[str, Any]):
    from tidal import SamplingParams

    # ignore_eos: every request generates exactly max_tokens, as llama.cpp's benches do.
    chosen = {"temperature": 0.0, **sampling}
    return SamplingParams(**chosen, max_tokens=max_tokens, ignore_eos=True)


class _Prompts:
    """Seeded random prompts (BOS + ids from the vocabulary); a new seed for every call."""

    def __init__(self, seed: int, vocab_size: int, bos_token_id: int | None) -> None:
        self._seed, self._vocab, self._bos = seed, vocab_size, bos_token_id

    def take(self, num: int, length: int, same: bool = False) -> list[list[int]]:
        """`num` prompts of `length` tokens; with `same`, one prompt `num` times."""
        from tidal.bench.workload import make_workload

        self._seed += 1
        work = make_workload(1 if same else num, self._seed, self._vocab, min_prompt_len=length,
                             max_prompt_len=length, bos_token_id=self._bos)  # fmt: skip
        prompts = [w.prompt_token_ids for w in work]
        return [list(prompts[0]) for _ in range(num)] if same else prompts


def prefill_rate(llm, prompts: _Prompts, length: int, sampling: dict[str, Any]) -> float:
    params = _params(1, sampling)
    out = llm.generate(prompt_token_ids=prompts.take(1, length), sampling_params=params)[0]
    return length / (out.metrics.first_token_time_s - out.metrics.arrival_time_s)


def _prefilled(llm, batch: list[list[int]], sampling: dict[str, Any]) -> list[list[int]]:
    """`batch`, prefilled once (max_tokens=1) into the prefix cache when its prompts take more
    than one step's token budget, so that a run on them takes every first token in one step."""
    total = sum(len(p) for p in batch)
    if total > llm.config.scheduler.max_num_batched_tokens:
        if not llm.config.cache.enable_prefix_caching:
            raise ValueError(
                f"{len(batch)} prompts of {total // len(batch)} tokens take several prefill "
                "steps, which a decode window would count: decode measures need the prefix "
                "cache (enable_prefix_caching) for prompts this long"
            )
        llm.generate(prompt_token_ids=batch, sampling_params=_params(1, sampling))
    return batch


def decode_rate(
    llm,
    prompts: _Prompts,
    num_seqs: int,
    prompt_len: int,
    tokens: int,
    sampling: dict[str, Any],
    same: bool = False,
) -> float:
    """Decode tokens/s of num_seqs sequences generating `tokens` each after their first token
    (that one comes from the prefill). The window opens at the first sequence's first token, so
    a prefill that spreads over several steps counts against tidal, never for it. Prompts that
    do not fit one step's token budget are prefilled first (max_tokens=1), so that the timed
    run's prompts hit the prefix cache and every first token comes from one step: decode alone,
    as llama-batched-bench's S_TG times it after its prompts. `same`: every sequence the same
    prompt (MoE models, see run_tidal)."""
    batch = _prefilled(llm, prompts.take(num_seqs, prompt_len, same), sampling)
    outs = llm.generate(prompt_token_ids=batch, sampling_params=_params(tokens + 1, sampling))
    for o in outs:
        if len(o.outputs[0].token_ids) != tokens + 1:
            raise RuntimeError(f"expected {tokens + 1} tokens, got {len(o.outputs[0].token_ids)}")
    first = min(o.metrics.first_token_time_s for o in outs)
    last = max(o.metrics.last_token_time_s or o.metrics.finished_time_s for o in outs)
    return num_seqs * tokens / (last - first)


def run_tidal(
    cfg: KernelsConfig, model: Path, tidal_args: dict[str, Any], profile: bool
) -> tuple[dict[str, Measure], dict[str, Any], tuple[StepProfile, ...]]:
    import torch

    from tidal import LLM
    from tidal.loader.model_loader import read_arch
    from tidal.loader.resident import wait_promoted

    arch, _ = read_arch(model)
    # llama-bench's tg128 and the profile measure one token a step: no prompt-lookup drafts
    # (--tidal-arg num_speculative_tokens=4 measures them).
    tidal_args = {"num_speculative_tokens": 0, **tidal_args}
    llm = LLM(str(model), threads=cfg.threads, **tidal_args)
    # NOTE: the large matrices move into huge pages in a background thread after the engine is
    # built (tidal/loader/resident.py); nothing is timed until that copy is done
    wait_promoted()
    prompts = _Prompts(cfg.seed, arch.vocab_size, arch.bos_token_id)
    # llama-batched-bench feeds every sequence the same tokens (id 0, prompt and generation):
    # a dense model does the same work either way, but a mixture of experts routes identical
    # sequences to the same experts and reads a fraction of the weights that distinct ones read.
    # On MoE models tidal's batched sequences share one prompt (greedy: the same tokens after),
    # like for like; `batched_distinct` adds the distinct-prompt figure users' traffic sees.
    same = arch.moe is not None
    settings = {"args": tidal_args, "threads": torch.get_num_threads(), "torch": torch.__version__,
                "num_layers": arch.num_layers, "config": asdict(llm.config),
                "kernels": kernel_paths(), "batched_same_prompt": same}  # fmt: skip
    n, p = cfg.decode_tokens, cfg.prompt_tokens
    pp_name, tg_name, batched_name = cfg.names()
    # Warm-up, excluded: one of each shape.
    sampling = cfg.sampling
    prefill_rate(llm, prompts, p, sampling)
    decode_rate(llm, prompts, cfg.batch_seqs, cfg.batch_prompt_tokens, 4, sampling, same)
    reps = range(cfg.repetitions)
    pp = Measure(tuple(prefill_rate(llm, prompts, p, sampling) for _ in reps))
    print(f"tidal {pp_name}: {pp.median:.1f} tok/s", file=sys.stderr, flush=True)
    tg = Measure(tuple(
        decode_rate(llm, prompts, 1, cfg.tg_prompt_tokens, n, sampling) for _ in reps
    ))  # fmt: skip
    print(f"tidal {tg_name}: {tg.median:.1f} tok/s", file=sys.stderr, flush=True)
    batched = Measure(tuple(
        decode_rate(llm, prompts, cfg.batch_seqs, cfg.batch_prompt_tokens, n, sampling, same)
        for _ in reps
    ))  # fmt: skip
    print(f"tidal {batched_name}: {batched.median:.1f} tok/s", file=sys.stderr, flush=True)
    if same:
        distinct = Measure(tuple(
            decode_rate(llm, prompts, cfg.batch_seqs, cfg.batch_prompt_tokens, n, sampling)
            for _ in reps
        ))  # fmt: skip
        settings["batched_distinct"] = asdict(distinct)
        print(f"tidal {batched_name}, distinct prompts: {distinct.median:.1f} tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
    steps = ()  # one sequence, then the batched measure's sequences together
    if profile:
        steps = tuple(_profile(llm, prompts, cfg, arch.num_layers, seqs)
                      for seqs in (1, cfg.batch_seqs))  # fmt: skip
    return {pp_name: pp, tg_name: tg, batched_name: batched}, settings, steps


def _profile(llm, prompts: _Prompts, cfg: KernelsConfig, num_layers: int, seqs: int) -> StepProfile:
    """profile_decode of `seqs` new prompts: the tg measure's length for one, the batched
    measure's for several (prefilled first where they take more than one step)."""
    length = cfg.tg_prompt_tokens if seqs == 1 else cfg.batch_prompt_tokens
    batch = _prefilled(llm, prompts.take(seqs, length), cfg.sampling)
    return profile_decode(llm, batch, cfg.profile_steps, num_layers,
                          lambda n: _params(n, cfg.sampling))  # fmt: skip


# Environment settings that lower the code paths of tidal's kernels or of torch's own ops.
ISA_CAPS = ("TIDAL_KERNEL_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def kernel_paths() -> dict[str, Any]:
    """The code path each of tidal's CPU kernels runs in this process (None: not built), and the
    ISA_CAPS settings that are set: a run with the paths lowered says so in its report."""
    import os

    from tidal.kernels import gguf_gemm, paged_attention, sample
    from tidal.kernels.isa import ISA_NAMES

    names = {code: name for name, code in ISA_NAMES.items()}
    paths = {
        "gguf_gemm": gguf_gemm.default_isa() if gguf_gemm.available() else None,
        "paged_attention": (names[paged_attention.default_isa()]
                            if paged_attention.available() else None),
        "sample": sample.default_isa() if sample.available() else None,
    }  # fmt: skip
    caps = {k: os.environ[k] for k in ISA_CAPS if os.environ.get(k)}
    return {"paths": paths, "caps": caps}


# --------------------------------------------------------------------------------------------
# Report and command


def cpu_flags(text: str | None = None) -> dict[str, bool]:
    """Which RELEVANT_FLAGS the CPU has (from /proc/cpuinfo's first `flags` line)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    m = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    have = set(m.group(1).split()) if m else set()
    return {f: f in have for f in RELEVANT_FLAGS}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = KernelsConfig()
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled Gemma 3 270M)")
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads for both systems")
    p.add_argument("--repetitions", type=int, default=d.repetitions)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help="the pp measure's prompt length (e.g. 6000 for a long document)")  # fmt: skip
    p.add_argument("--batch-seqs", type=int, default=d.batch_seqs,
                   help="sequences of the batched decode measure")  # fmt: skip
    p.add_argument("--batch-prompt-tokens", type=int, default=d.batch_prompt_tokens,
                   help="each batched sequence's prompt (e.g. 2048: decode over long chats)")  # fmt: skip
    p.add_argument("--baselines", default=None, metavar="NAME[,NAME]",
                   help=f"baselines beside tidal, from {list(BASELINES)} (default: those whose "
                   "llama-bench is built, else llama.cpp)")  # fmt: skip
    p.add_argument("--llama-bin-dir", default=None,
                   help="where llama.cpp's llama-bench and llama-batched-bench are "
                   "(default: tidal's cache)")  # fmt: skip
    p.add_argument("--ik-bin-dir", default=None,
                   help="where ik_llama.cpp's are (default: tidal's cache, where "
                   "scripts/build_ik_llama.sh puts them)")  # fmt: skip
    p.add_argument("--tidal-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="passed to tidal.LLM(...), e.g. quantization=int8 or dtype=bfloat16")  # fmt: skip
    p.add_argument("--sampling", action="append", default=None, metavar="KEY=VALUE",
                   help="tidal's requests sample with these SamplingParams fields, e.g. "
                   "temperature=0.8 (default: greedy)")  # fmt: skip
    p.add_argument("--no-llama", dest="llama", action="store_false",
                   help="tidal's side only (no baselines)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="split decode steps (one sequence, then the batched measure's) into native "
                   "kernels, the sampler, aten and the rest")  # fmt: skip
    p.add_argument("--profile-steps", type=int, default=d.profile_steps)
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--markdown", default=None, help="write the tables here")


def baseline_list(text: str | None, bin_dirs: dict[str, str | None]) -> list[Baseline]:
    """--baselines "llama.cpp,ik_llama.cpp" -> those baselines, in that order; None: each one
    whose llama-bench is in its bin dir (bin_dirs: the --*-bin-dir options), else llama.cpp
    alone (whose note then says how to build it)."""
    if text is None:
        built = [b for b in BASELINES.values()
                 if b.find(b.bin_dir(bin_dirs.get(b.name)), "llama-bench")]  # fmt: skip
        return built or [LLAMA_CPP]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown or not names:
        raise ValueError(f"--baselines={text!r} is invalid: expected names from {list(BASELINES)}")
    return [BASELINES[n] for n in dict.fromkeys(names)]


def run(args: argparse.Namespace) -> int:
    """`tidal bench kernels`: the baselines' two benches, then tidal's, on one GGUF; one report."""
    from tidal.bench.report import machine_info, write_markdown

    for name in ("threads", "repetitions", "profile_steps", "prompt_tokens", "batch_seqs",
                 "batch_prompt_tokens"):  # fmt: skip
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)} is invalid: expected an integer >= 1")
    cfg = KernelsConfig(threads=args.threads, repetitions=args.repetitions, seed=args.seed,
                        profile_steps=args.profile_steps, prompt_tokens=args.prompt_tokens,
                        batch_seqs=args.batch_seqs, batch_prompt_tokens=args.batch_prompt_tokens,
                        sampling=parse_sampling_args(args.sampling or ()))  # fmt: skip
    tidal_args = parse_tidal_args(args.tidal_arg or ())
    if args.model:
        gguf = Path(args.model)
    else:
        from tidal.loader.bundled import bundled_model_path

        gguf = bundled_model_path()
    bin_dirs = {LLAMA_CPP.name: args.llama_bin_dir, IK_LLAMA_CPP.name: args.ik_bin_dir}
    chosen = baseline_list(args.baselines, bin_dirs) if args.llama else []
    started = time.perf_counter()
    measures: dict[str, dict[str, Measure]] = {}
    infos: dict[str, dict[str, Any]] = {}
    for b in chosen:
        measures[b.name], infos[b.name] = run_baseline(cfg, gguf, b, b.bin_dir(bin_dirs[b.name]))
    tidal, settings, steps = run_tidal(cfg, gguf, tidal_args, args.profile)
    llama, ik = measures.get(LLAMA_CPP.name, {}), measures.get(IK_LLAMA_CPP.name, {})
    ik_chosen = infos.get(IK_LLAMA_CPP.name, {}).get("chosen", {})
    rows = [Row(name, tidal.get(name), llama.get(name), ik.get(name), ik_chosen.get(name))
            for name in cfg.names()]  # fmt: skip
    why = "not run (--no-llama)" if not args.llama else "not run (--baselines)"
    record: dict[str, Any] = {
        "machine": machine_info(),
        "cpu_flags": cpu_flags(),
        "threads": cfg.threads,
        "gguf": str(gguf),
        "repetitions": cfg.repetitions,
        "workload": asdict(cfg),
        "tidal": settings,
        LLAMA_CPP.key: infos.get(LLAMA_CPP.name, {"notes": [why]}),  # always there, as before
        **{b.key: infos[b.name] for b in chosen if b is not LLAMA_CPP},
        "measures": [r.record() for r in rows],
        "profiles": [
            {**asdict(p), "other_s": p.other_s, "native_by_name": dict(p.native_by_name)}
            for p in steps
        ],
        "seconds": time.perf_counter() - started,
    }
    for r in rows:
        print(r.line())
    table = markdown_report(record, rows, steps)
    print(table)
    if args.json:
        text = json.dumps(record, indent=1, allow_nan=False, default=str)  # default: Paths
        Path(args.json).write_text(text + "\n")
    if args.markdown:
        write_markdown(args.markdown, table)
    return 0
