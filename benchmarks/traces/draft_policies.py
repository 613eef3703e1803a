"""Drafting policies side by side on one engine (benchmarks/README.md, "Drafts planned per
sequence"): N sequences of 64 random README words, 64 tokens each, generated in rounds that
alternate three schedulers over the same loaded model, so the host's drift hits each alike:

- planner: tidal's default (DraftPlanner, batching.speculative_step_rows R, up to 16 sequences)
- fixed: every proposal checked while at most 4 sequences decode (the policy before it)
- none: num_speculative_tokens=0

    python benchmarks/traces/draft_policies.py TEMPERATURE N ROUNDS [R]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from tidal import LLM, SamplingParams
from tidal.scheduler.drafting import DraftPlanner


def main() -> None:
    temperature, n, rounds = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    step_rows = float(sys.argv[4]) if len(sys.argv) > 4 else 8.0
    words = (Path(__file__).parents[2] / "README.md").read_text().split()
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(words) for _ in range(64)) for _ in range(n)]
    llm = LLM(max_num_seqs=max(n, 4))
    sched = llm.engine.scheduler
    row_block = sched._drafter.row_block if sched._drafter is not None else 1
    base = sched.config
    policies = {
        "planner": replace(base, num_speculative_tokens=4, speculative_max_num_seqs=16,
                           speculative_step_rows=step_rows),
        "fixed": replace(base, num_speculative_tokens=4, speculative_max_num_seqs=4,
                         speculative_step_rows=1e6),
        "none": replace(base, num_speculative_tokens=0),
    }  # fmt: skip
    steps: list = []
    llm.engine.on_step = steps.append
    params = SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True, seed=1)
    llm.generate(prompts, params)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in policies}
    drafts = {name: [0, 0] for name in policies}
    for _ in range(rounds):
        for name, config in policies.items():
            sched.config = config
            sched._drafter = (
                DraftPlanner(config, row_block) if config.num_speculative_tokens else None
            )
            steps.clear()
            start = time.perf_counter()
            llm.generate(prompts, params)
            rates[name].append(n * 64 / (time.perf_counter() - start))
            drafts[name][0] += sum(s.num_draft_tokens for s in steps)
            drafts[name][1] += sum(s.num_accepted_tokens for s in steps)
    line = f"N={n} T={temperature} R={step_rows}:"
    for name, r in rates.items():
        d, a = (x // rounds for x in drafts[name])
        line += f" {name} {statistics.median(r):.0f} tok/s [{min(r):.0f}-{max(r):.0f}] drafts/kept {d}/{a};"
    for name in ("planner", "fixed"):
        ratios = [a / b for a, b in zip(rates[name], rates["none"], strict=True)]
        line += (
            f" {name}/none {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
        )
    print(line)


if __name__ == "__main__":
    main()
