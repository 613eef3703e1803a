"""`tidal serve` on a tiny DeepSeek-V3 (MLA + MoE), driven by the openai SDK: completions give
transformers' greedy text, and /metrics shows the expert load (the StepStats field crosses the
engine-process boundary). Slow: it starts a server (20-60 s on a shared 2-core machine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.tiny import make_tiny_model_dir
from tests.server.tiny_server import ServerProcess, serve

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("serve_deepseek_v3"), "deepseek_v3")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    yield from serve(
        ["--model", str(model_dir), "--kv-cache-bytes", str(1 << 20), "--no-warmup",
         "--served-model-name", "tiny-deepseek"]
    )  # fmt: skip


def test_completion_is_transformers_greedy_text(server: ServerProcess, model_dir: Path) -> None:
    import openai
    import transformers as tf

    from tidal.loader.tokenizer import load_tokenizer

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=60)
    prompt = "The tide comes in and the tide goes out."
    out = client.completions.create(
        model="tiny-deepseek", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    tok = load_tokenizer(model_dir, "deepseek_v3")
    ids = tok.encode(prompt)
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            eos_token_id=tok.eos_token_id,
        )[0, len(ids) :].tolist()  # fmt: skip
    if tok.eos_token_id in gen:  # the server stops at EOS without printing it
        gen = gen[: gen.index(tok.eos_token_id)]
    assert out.choices[0].text == tok.decode(gen)
    assert out.usage.prompt_tokens == len(ids)

    import httpx2 as httpx

    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    count = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tidal:moe_expert_tokens_count")
    )
    assert count > 0 and count % 8 == 0  # one observation per expert (8) per step
