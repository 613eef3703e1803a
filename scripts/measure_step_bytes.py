"""Measure the bytes per generated token that cross from the engine process to the API process.

Runs the EngineLoop (engine/loop.py) on the bundled model in this process with a `send` that
pickles each StepOutputs exactly as the engine process's pipe does (ForkingPickler), for one
greedy request: a 500-token prompt and 64 generated tokens, with prompt logprobs off, on, and on
with sampled-token logprobs. Heartbeats are not counted.

    python scripts/measure_step_bytes.py

Prints one line per case and, last, one JSON record with every figure.
"""

from __future__ import annotations

import json
import queue
import threading
from multiprocessing.reduction import ForkingPickler

from tidal.config.cache import CacheConfig
from tidal.config.engine import EngineConfig
from tidal.engine.builder import build_engine
from tidal.engine.loop import EngineLoop
from tidal.engine.messages import AddRequest, Shutdown, StepOutputs
from tidal.sampling_params import SamplingParams

PROMPT_TOKENS = 500
MAX_TOKENS = 64


def measure(core, prompt: list[int], params: SamplingParams, request_id: str) -> dict[str, float]:
    sizes = {"output_bytes": 0, "stats_only_bytes": 0}
    done: queue.SimpleQueue[None] = queue.SimpleQueue()
    num_tokens = 0

    def send(msg: StepOutputs) -> None:
        nonlocal num_tokens
        key = "output_bytes" if msg.outputs or msg.failures else "stats_only_bytes"
        sizes[key] += len(ForkingPickler.dumps(msg))
        for out in msg.outputs:
            num_tokens += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                done.put(None)

    loop = EngineLoop(core, send)
    loop.put(AddRequest(request_id, prompt, params))

    def stop_when_done() -> None:
        done.get()
        loop.put(Shutdown())

    threading.Thread(target=stop_when_done, daemon=True).start()
    loop.run()
    total = sizes["output_bytes"] + sizes["stats_only_bytes"]
    return {
        "tokens": num_tokens,
        "bytes_per_token": total / num_tokens,
        "output_bytes_per_token": sizes["output_bytes"] / num_tokens,
        **sizes,
    }


def main() -> None:
    core = build_engine(EngineConfig(cache=CacheConfig(kv_cache_bytes=64 << 20)))
    text = " ".join(f"word{i} is a fine token to repeat" for i in range(400))
    prompt = core.tokenizer.encode(text)[:PROMPT_TOKENS]
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    cases = {
        "prompt_logprobs_off": SamplingParams(**greedy),
        "prompt_logprobs_1": SamplingParams(**greedy, prompt_logprobs=1),
        "prompt_logprobs_1_logprobs_1": SamplingParams(**greedy, prompt_logprobs=1, logprobs=1),
    }
    record = {}
    for name, params in cases.items():
        record[name] = r = measure(core, prompt, params, name)
        print(
            f"{name}: {r['tokens']} tokens, {r['bytes_per_token']:.0f} B per token "
            f"({r['output_bytes_per_token']:.0f} B in messages with outputs)",
            flush=True,
        )
    print(json.dumps({"prompt_tokens": len(prompt), "cases": record}))


if __name__ == "__main__":
    main()
