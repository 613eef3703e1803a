"""Error paths, disconnects, overload, deadlines and /metrics of a real `tidal serve` subprocess."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, MAX_BODY_BYTES, MAX_INPUT_TOKENS
from tests.server.tiny_server import ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _client(server: ServerProcess, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.base_url + "/v1", max_retries=0, timeout=60)


def _metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample as 'name{label=value,...}' -> value."""
    text = httpx.get(server.base_url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _wait_metric(server: ServerProcess, name: str, value: float, timeout_s: float = 30) -> None:
    """Poll /metrics until `name` equals `value` (state converges; no fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _metrics(server).get(name) == value:
            return
        time.sleep(0.02)
    raise AssertionError(f"{name} never became {value}: {_metrics(server).get(name)}")


def _post(server: ServerProcess, path: str, **kw) -> httpx.Response:
    return httpx.post(
        server.base_url + path, headers={**AUTH, **kw.pop("headers", {})}, timeout=60, **kw
    )


def test_bad_json_and_wrong_type_are_400(server: ServerProcess) -> None:
    r = _post(
        server,
        "/v1/completions",
        content=b'{"prompt": "x",',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(
            model="tiny", prompt="x", extra_body={"temperature": "hot"}
        )
    assert e.value.param == "temperature"


def test_unknown_model_is_404(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.code == "model_not_found"


def test_prompt_over_limit_and_max_tokens_past_context_are_400(server: ServerProcess) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a" * MAX_INPUT_TOKENS, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", max_tokens=256)  # context is 256
    assert e.value.param == "max_tokens"
    ok = client.completions.create(model="tiny", prompt="a" * (MAX_INPUT_TOKENS - 1), max_tokens=1)
    assert ok.usage.prompt_tokens == MAX_INPUT_TOKENS


def test_wrong_or_missing_key_is_401(server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="sk-wrong").models.list()
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes need no key


def test_a_body_declared_as_a_form_or_text_is_415(server: ServerProcess) -> None:
    # What a page on any site may send without a preflight; JSON types and no type are read.
    body = b'{"prompt": "x", "max_tokens": 1}'
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
        r = _post(server, "/v1/completions", content=body, headers={"content-type": kind})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert "application/json" in r.json()["error"]["message"]
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        headers = {"content-type": kind} if kind else {}
        assert _post(server, "/v1/completions", content=body, headers=headers).status_code == 200


def test_body_over_limit_is_413(server: ServerProcess) -> None:
    r = _post(server, "/v1/completions", json={"prompt": "x" * MAX_BODY_BYTES})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_deadline_is_504_and_sse_error(server: ServerProcess) -> None:
    client = _client(server)
    kw = dict(
        model="tiny",
        prompt="slow",
        max_tokens=200,
        temperature=0,
        extra_body={"ignore_eos": True, "timeout_s": 0.001},
    )
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**kw)
    assert e.value.status_code == 504
    with pytest.raises(openai.APIError) as e2:
        list(client.completions.create(**kw, stream=True))
    assert "deadline" in str(e2.value)


def test_a_deadline_that_passes_mid_stream_ends_it_and_frees_its_blocks(
    server: ServerProcess,
) -> None:
    """timeout_s passes after the first tokens were streamed: the stream ends with one
    deadline_exceeded error event and [DONE] (docs/serving.md), the server stays healthy, and the
    request's KV blocks are freed."""
    timeout_s = 5.0
    before = _metrics(server)
    stream = _client(server).completions.create(
        model="tiny", prompt="Long story", max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "timeout_s": timeout_s},
    )  # fmt: skip
    texts = []
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            texts.append(chunk.choices[0].text)
            if len(texts) == 1:
                # The request arrived before its first token did, so its deadline lies at most
                # timeout_s from now: the engine stays paused past it with 199 tokens to go,
                # so the deadline passes mid-stream however fast or slow the machine.
                resume_at = time.monotonic() + timeout_s + 0.5
                with server.engine_paused():
                    while time.monotonic() < resume_at:
                        time.sleep(0.05)
    assert texts and texts[0] != "", texts
    assert len(texts) < 200
    assert e.value.code == "deadline_exceeded", e.value.body
    assert f"deadline of {timeout_s:g} s" in str(e.value)
    _wait_metric(server, "tidal:num_requests_running", 0)
    _wait_metric(server, "tidal:kv_cache_usage_ratio", 0.0)
    after = _metrics(server)
    key = "tidal:request_success_total{finished_reason=deadline}"
    assert after[key] == before.get(key, 0) + 1
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.base_url + "/ready", timeout=30).status_code == 200
    # And it still serves.
    ok = _client(server).completions.create(
        model="tiny", prompt="again", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.choices[0].finish_reason == "length"


def test_disconnects_free_the_kv_cache(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "Long story", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert _metrics(server)["tidal:num_requests_running"] == 1
        # Leaving the block closes the connection mid-stream.
    _wait_metric(server, "tidal:num_requests_running", 0)
    _wait_metric(server, "tidal:kv_cache_usage_ratio", 0.0)
    before = _metrics(server).get("tidal:request_success_total{finished_reason=abort}", 0)
    assert before >= 1
    # Non-streaming: the client gives up while the request runs and holds KV blocks. The engine
    # is paused (SIGSTOP) from then until the server has counted the abort, so the request cannot
    # finish first however fast the machine: only the disconnect can end it.
    body.update(stream=False, max_tokens=255 - 11)
    finished = _metrics(server).get("tidal:request_success_total{finished_reason=length}", 0)
    payload = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=60)
    try:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode() + b"\r\n\r\n" + payload
        )  # fmt: skip
        # Prefilled and decoding: one request running with its blocks allocated.
        server.wait_until(
            lambda: (
                (m := _metrics(server))["tidal:num_requests_running"] == 1
                and m["tidal:kv_cache_usage_ratio"] > 0
            ),
            "the request running",
            60,
        )
        with server.engine_paused():
            conn.close()  # the client gives up mid-request
            _wait_metric(
                server, "tidal:request_success_total{finished_reason=abort}", before + 1, 20
            )
        # NOTE: the pause lands milliseconds after the poll saw the request decoding, far too
        # soon for its 243 decode steps (a model forward each); should that ever fail to hold,
        # this names it instead of a confusing abort count.
        assert (
            _metrics(server).get("tidal:request_success_total{finished_reason=length}", 0)
            == finished
        ), "the request finished before the engine was paused"
    finally:
        conn.close()
    _wait_metric(server, "tidal:num_requests_running", 0)
    _wait_metric(server, "tidal:kv_cache_usage_ratio", 0.0)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 200}),
    ],
)  # fmt: skip
def test_a_stream_left_midway_is_aborted_on_the_chat_routes(
    server: ServerProcess, path: str, fields: dict
) -> None:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "stream": True, **fields}
    before = _metrics(server).get("tidal:request_success_total{finished_reason=abort}", 0)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + path, json=body, headers=AUTH) as r:
            assert r.status_code == 200
            assert next(r.iter_lines())  # the first event: the request is generating
        # Leaving the block closes the connection mid-stream.
    _wait_metric(server, "tidal:request_success_total{finished_reason=abort}", before + 1, 20)
    _wait_metric(server, "tidal:num_requests_running", 0)
    _wait_metric(server, "tidal:kv_cache_usage_ratio", 0.0)


def test_metrics_move_after_traffic(server: ServerProcess) -> None:
    before = _metrics(server)
    _client(server).completions.create(
        model="tiny",
        prompt="count me",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = _metrics(server)
    assert after["tidal:generation_tokens_total"] - before["tidal:generation_tokens_total"] == 5
    assert after["tidal:prompt_tokens_total"] - before["tidal:prompt_tokens_total"] == 9
    for name in ("tidal:time_to_first_token_seconds_count", "tidal:e2e_request_latency_seconds_count",
                 "tidal:request_queue_time_seconds_count", "tidal:step_duration_seconds_count",
                 "tidal:iteration_tokens_count", "tidal:batch_utilization_count"):  # fmt: skip
        assert after[name] > before[name], name
    # One gap per step after the first token's: 4 one token a step, fewer when drafts held.
    gaps = (
        after["tidal:inter_token_latency_seconds_count"]
        - before["tidal:inter_token_latency_seconds_count"]
    )
    accepted = (
        after["tidal:spec_decode_num_accepted_tokens_total"]
        - before["tidal:spec_decode_num_accepted_tokens_total"]
    )
    assert gaps == 4 - accepted
    assert after["tidal:request_success_total{finished_reason=length}"] >= 1
    assert after["tidal:prefix_cache_queries_total"] > before["tidal:prefix_cache_queries_total"]
    assert after["tidal:process_memory_bytes"] > 0 and after["tidal:model_load_seconds"] > 0
    assert 0 < after["tidal:memory_fraction"] <= 1


def test_queue_full_is_429(narrow_server: ServerProcess) -> None:
    """One running seat and one waiting seat: of 6 simultaneous 200-token requests, the ones that
    arrive while the waiting seat is taken get 429 with Retry-After; the others complete in full."""
    srv = narrow_server

    async def run_all() -> list[object]:
        client = openai.AsyncOpenAI(
            api_key="none", base_url=srv.base_url + "/v1", max_retries=0, timeout=60
        )
        try:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=None,
                        prompt=f"Busy {i}",
                        max_tokens=200,
                        temperature=0,  # type: ignore[arg-type]
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    for i in range(6)
                ),
                return_exceptions=True,
            )
        finally:
            await client.close()

    results = asyncio.run(run_all())
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert len(rejected) + len(served) == 6, results
    # Arrivals before the first step all wait, so possibly only one is served.
    assert len(rejected) >= 1 and len(served) >= 1
    # Retry-After comes from recent throughput (at least 1 s; 1 s while the rate is unknown).
    assert all(int(r.response.headers["retry-after"]) >= 1 for r in rejected)
    assert all(r.usage.completion_tokens == 200 for r in served)
    assert _metrics(srv)["tidal:request_rejected_total{reason=queue_full}"] == len(rejected)


def test_print_config_exits_0() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tidal.cli_serve", "--print-config", "--port", "9", "--api-key", "sk-secret"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "port: 9" in out.stdout and "sk-secret" not in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tidal.cli_serve", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "port" in bad.stderr
