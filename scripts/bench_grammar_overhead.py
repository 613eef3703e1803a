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

from tidal import LLM, SamplingParams
from tidal.engine.stats import StepStats
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
    for _ in range(args.rounds):
        runs["free"] += decode_steps(free)
        runs["constrained"] += decode_steps(constrained)
    free_ms = [s.step_time_s * 1e3 for s in runs["free"]]
    con_ms = [s.step_time_s * 1e3 for s in runs["constrained"]]
    mask_ms = [s.grammar_mask_s * 1e3 for s in runs["constrained"]]
    record = {
        "rows": args.rows,
        "decode_steps": [len(free_ms), len(con_ms)],
        "free_step_ms_median": round(statistics.median(free_ms), 2),
        "constrained_step_ms_median": round(statistics.median(con_ms), 2),
        "overhead_pct": round(100 * (statistics.median(con_ms) / statistics.median(free_ms) - 1), 1),
        "mask_ms_per_step_median": round(statistics.median(mask_ms), 3),
        "mask_ms_per_step_p90": round(sorted(mask_ms)[int(0.9 * (len(mask_ms) - 1))], 3),
    }
    print(
        f"{args.rows} rows: step {record['free_step_ms_median']} ms free vs "
        f"{record['constrained_step_ms_median']} ms constrained ({record['overhead_pct']:+}%), "
        f"mask {record['mask_ms_per_step_median']} ms/step (p90 {record['mask_ms_per_step_p90']})"
    )
    print(json.dumps(record))


if __name__ == "__main__":
    main()
