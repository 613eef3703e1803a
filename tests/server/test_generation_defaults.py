"""The checkpoint's recommended sampling as request defaults, end to end: `tidal serve` on a tiny
checkpoint whose generation_config.json recommends greedy decoding and 6 new tokens (plus a
--override-generation-config), read with the openai SDK; tidal.LLM and `tidal generate` on the
same checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import KV_BYTES
from tests.server.tiny_server import ServerProcess, make_tiny_checkpoint, serve
from tidal import LLM, SamplingParams

RECOMMENDED_TOKENS = 6
USER = [{"role": "user", "content": "Tell me a story."}]
ALL = {"ignore_eos": True}  # every request runs to its token limit: counts are exact


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_recommends"))
    path = root / "generation_config.json"
    gen = json.loads(path.read_text()) if path.exists() else {}
    gen.update(temperature=0.0, max_new_tokens=RECOMMENDED_TOKENS, top_k=None)
    path.write_text(json.dumps(gen))
    return root


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[ServerProcess]:
    override = '{"repetition_penalty": 1.0}'
    args = ["--model", str(checkpoint), "--kv-cache-bytes", KV_BYTES, "--no-warmup"]
    yield from serve([*args, "--override-generation-config", override])


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="none", base_url=server.base_url + "/v1", max_retries=0, timeout=60
    )


def test_the_server_says_which_defaults_it_took(server: ServerProcess) -> None:
    assert (
        "requests that leave them unset sample with temperature=0, max_tokens=6, "
        "repetition_penalty=1" in server.log
    )
    assert "generation_config.json + override_generation_config" in server.log


def test_a_chat_that_sets_nothing_samples_as_the_model_recommends(server: ServerProcess) -> None:
    c = _client(server)
    model = c.models.list().data[0].id
    unset = c.chat.completions.create(model=model, messages=USER, extra_body=ALL)
    assert unset.usage.completion_tokens == RECOMMENDED_TOKENS
    greedy = c.chat.completions.create(
        model=model, messages=USER, temperature=0, max_tokens=RECOMMENDED_TOKENS, extra_body=ALL
    )
    assert unset.choices[0].message.content == greedy.choices[0].message.content
    # what the request sets wins: its own limit, and sampling at temperature 1 (seeded)
    short = c.chat.completions.create(model=model, messages=USER, max_tokens=3, extra_body=ALL)
    assert short.usage.completion_tokens == 3
    sampled = {
        c.chat.completions.create(
            model=model, messages=USER, temperature=1.0, seed=seed, extra_body=ALL
        )
        .choices[0]
        .message.content
        for seed in (1, 2, 3)
    }
    assert sampled - {greedy.choices[0].message.content}, "temperature=1 was not honoured"


def test_completions_keep_openai_16_unless_the_limit_is_null(server: ServerProcess) -> None:
    c = _client(server)
    model = c.models.list().data[0].id
    left_out = c.completions.create(model=model, prompt="Once", extra_body=ALL)
    assert left_out.usage.completion_tokens == 16
    null = c.completions.create(model=model, prompt="Once", max_tokens=None, extra_body=ALL)
    assert null.usage.completion_tokens == RECOMMENDED_TOKENS


def test_generation_config_none_keeps_openai_defaults(checkpoint: Path) -> None:
    args = ["--model", str(checkpoint), "--kv-cache-bytes", KV_BYTES, "--no-warmup"]
    for srv in serve([*args, "--generation-config", "none", "--no-log-requests"]):
        c = _client(srv)
        model = c.models.list().data[0].id
        out = c.chat.completions.create(model=model, messages=USER, max_tokens=40, extra_body=ALL)
        assert out.usage.completion_tokens == 40  # no recommended 6
        assert "requests that leave them unset" not in srv.log
        assert "tidal.server.requests" not in srv.log  # server.log_requests false


def test_a_bad_recommendation_stops_the_server_naming_it(tmp_path: Path) -> None:
    root = make_tiny_checkpoint(tmp_path / "bad")
    (root / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    cmd = [sys.executable, "-m", "tidal.cli_serve", "--model", str(root), "--port", "0"]
    done = subprocess.run(
        [*cmd, "--host", "127.0.0.1", "--kv-cache-bytes", KV_BYTES, "--no-warmup"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "generation_config.json: top_p=7.0 is invalid" in done.stderr


def test_llm_and_tidal_generate_use_the_recommendation(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_cache_bytes=int(KV_BYTES))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, RECOMMENDED_TOKENS)
    unset = llm.generate(["Once"])[0].outputs[0]
    greedy = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert unset.token_ids == greedy.token_ids
    # an explicit SamplingParams is taken as it is (vLLM's LLM does the same)
    assert len(llm.generate(["Once"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) <= 2
    del llm
    cli = [sys.executable, "-m", "tidal.cli", "generate", "--model", str(checkpoint)]
    done = subprocess.run([*cli, "Once"], capture_output=True, text=True, timeout=120, check=True)
    assert "sampling with the model's temperature=0, max_tokens=6" in done.stderr
    assert done.stdout.startswith("Once" + greedy.text)
