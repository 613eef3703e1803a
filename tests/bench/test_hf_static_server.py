"""The HF static-batching baseline server on a tiny checkpoint: OpenAI-style answers and a bench run."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.tiny_server import make_tiny_checkpoint
from tidal.bench.cli import main as bench_main
from tidal.bench.compare import ServerHandle


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("hf_tiny_ckpt"))
    log = tmp_path_factory.mktemp("hf_log") / "hf.log"
    cmd = [sys.executable, "-m", "tidal.bench.hf_static_server", "--model", str(ckpt),
           "--port", "0", "--batch-size", "3", "--threads", "1", "--served-model-name", "tiny-hf"]  # fmt: skip
    handle = ServerHandle(cmd, log)
    try:
        handle.wait_ready("/ready", timeout_s=180)
        yield handle
    finally:
        handle.stop()


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


def test_streaming_equals_non_streaming(hf_server: ServerHandle) -> None:
    url = f"{hf_server.base_url}/v1/completions"
    body = {"model": "tiny-hf", "prompt": "Hello there", "max_tokens": 6, "ignore_eos": True}
    whole = json.loads(_post(url, body))
    assert whole["usage"] == {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17}
    assert whole["choices"][0]["finish_reason"] == "length"
    raw = _post(url, {**body, "stream": True, "stream_options": {"include_usage": True}}).decode()
    events = [e[len("data: ") :] for e in raw.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"] == whole["usage"] and chunks[-1]["choices"] == []
    # Greedy: the stream spells the same text as the one-shot answer.
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_bad_prompt_is_400(hf_server: ServerHandle) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(f"{hf_server.base_url}/v1/completions", {"prompt": {"no": 1}})
    assert e.value.code == 400


def test_bench_run_against_the_baseline(hf_server: ServerHandle, tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    argv = ["run", "--base-url", hf_server.base_url, "--num-requests", "8", "--workload", "range",
            "--input-len", "5-20", "--output-len", "3-5", "--concurrency", "4", "--json", str(out),
            "--no-progress", "--server-pid", str(hf_server.proc.pid)]  # fmt: skip
    assert bench_main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["target"], run["num_ok"], run["num_errors"]) == ("tiny-hf", 8, 0)
    assert 24 <= run["num_output_tokens"] <= 40  # ignore_eos: each request gets its 3..5 tokens
    assert run["server"]["max_running"] is not None and run["server"]["max_running"] <= 3
    assert run["server"]["peak_rss_bytes"] > 0
