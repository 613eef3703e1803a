"""Grammar-mask overhead per decode step: 8 rows under a JSON schema vs the same 8 rows free.

Usage: python scripts/bench_grammar_overhead.py [--model PATH] [--rows 8] [--steps 32] [--rounds 2]

Runs the bundled model (or --model) through tidal.LLM, alternating an unconstrained batch and a
constrained one `--rounds` times (side by side, after a warm-up of each), and reads every decode
step's StepStats: step time, and for the constrained batch the mask time (computed on the mask
thread beside the forward). Prints one comparable line and a JSON record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tidal import LLM, SamplingParams
from tidal.engine.stats import StepStats
from tidal.layers.sampler import Sampler, SamplingRow
from tidal.sampling_params import StructuredOutputs

# Long enough that no row finishes before --steps decode steps: 40 bounded integers.
SCHEMA = {
    "type": "object",
    "properties": {
        "readings": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["readings"],
    "additionalProperties": False,
}
PROMPT = "Sensor log as JSON. Readings:"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    stats: list[StepStats] = []
    llm = LLM(args.model, on_step=stats.append, max_num_seqs=args.rows)
    spec = StructuredOutputs("json", json.dumps(SCHEMA))
    free = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.steps, structured_outputs=spec)

    def decode_steps(params: SamplingParams) -> list[StepStats]:
        stats.clear()
        # Distinct prompts: no prefix hit makes one batch cheaper than the other.
        prompts = [f"{PROMPT} #{i}" for i in range(args.rows)]
        outs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == args.steps for o in outs)
        return [s for s in stats if s.num_prefill_seqs == 0 and s.num_decode_seqs == args.rows]

    decode_steps(free)  # warm-up: kernels, the KV pool
    decode_steps(constrained)  # warm-up: the llguidance tokenizer, the compiled grammar
    runs: dict[str, list[StepStats]] = {"free": [], "constrained": []}
    rounds: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        a, b = decode_steps(free), decode_steps(constrained)
        runs["free"] += a
        runs["constrained"] += b
        rounds.append(tuple(statistics.median(s.step_time_s * 1e3 for s in r) for r in (a, b)))
    free_ms = [s.step_time_s * 1e3 for s in runs["free"]]
    con_ms = [s.step_time_s * 1e3 for s in runs["constrained"]]
    mask_ms = [s.grammar_mask_s * 1e3 for s in runs["constrained"]]
    sampler_ms = _sampler_ms(llm, spec, args.rows)
    record = {
        "rows": args.rows,
        "decode_steps": [len(free_ms), len(con_ms)],
        "free_step_ms_median": round(statistics.median(free_ms), 2),
        "constrained_step_ms_median": round(statistics.median(con_ms), 2),
        "overhead_pct": round(
            100 * (statistics.median(con_ms) / statistics.median(free_ms) - 1), 1
        ),
        "mask_ms_per_step_median": round(statistics.median(mask_ms), 3),
        "mask_ms_per_step_p90": round(sorted(mask_ms)[int(0.9 * (len(mask_ms) - 1))], 3),
        "round_step_ms_free_vs_constrained": [[round(a, 1), round(b, 1)] for a, b in rounds],
        "sampler_ms_free_vs_masked": sampler_ms,
    }
    print(
        f"{args.rows} rows: step {record['free_step_ms_median']} ms free vs "
        f"{record['constrained_step_ms_median']} ms constrained ({record['overhead_pct']:+}%), "
        f"mask {record['mask_ms_per_step_median']} ms/step (p90 {record['mask_ms_per_step_p90']}), "
        f"sampler {sampler_ms[0]} ms free vs {sampler_ms[1]} ms masked"
    )
    print(json.dumps(record))


def _sampler_ms(llm: LLM, spec: StructuredOutputs, rows: int) -> list[float]:
    """The sampler alone on (rows, V) logits: unconstrained vs the schema's first-token mask."""
    vocab = llm.engine.loaded.arch.vocab_size
    grammars = llm.engine.runner.grammars
    mask = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    grammars.fill("bench-mask", spec, [], mask)
    grammars.release("bench-mask")
    sampler = Sampler(vocab, "cpu")
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    out = []
    for bitmask in (None, mask):
        batch = [SamplingRow(greedy, [1], [], grammar_bitmask=bitmask) for _ in range(rows)]
        sampler(logits, batch)  # warm-up
        start = time.perf_counter()
        for _ in range(20):
            sampler(logits, batch)
        out.append(round((time.perf_counter() - start) / 20 * 1e3, 2))
    return out


if __name__ == "__main__":
    main()
