"""Malformed and random input against a real `tidal serve`: every body the protocol's fields can
be given (hypothesis, bounded) and hand-picked edge cases get a 2xx or 4xx, never a 5xx or a crash,
and the server still answers /health afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.tiny_server import ServerProcess, serve
from tidal.server.protocol import ChatCompletionRequest, CompletionRequest
from tidal.server.protocol_tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

MAX_INPUT_TOKENS = 64
# Bodies are drawn from the protocol models' own field names, each given any JSON value or a
# plausible one (test_openapi_fuzz.py drives schemathesis from the served /openapi.json instead).
FUZZ = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same examples every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot", ""]),
     "content": st.text(max_size=12) | _json},
)  # fmt: skip
_plausible = {
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 200), max_size=5),
    "messages": st.lists(_message, max_size=3),
    "max_tokens": st.integers(-2, 8) | st.just(10**12),
    "max_completion_tokens": st.integers(-2, 8),
    "n": st.integers(-1, 3),
    "tokens": st.lists(st.integers(-5, 300), max_size=5),
    "timeout_s": st.floats(-1, 1e9, allow_nan=False),
    "queue_timeout_s": st.floats(-1, 1e9, allow_nan=False),
}


def _bodies(*models: type) -> st.SearchStrategy[dict]:
    fields = sorted({name for m in models for name in m.model_fields})
    return st.fixed_dictionaries(
        {}, optional={f: (_plausible[f] | _json) if f in _plausible else _json for f in fields}
    )


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    yield from serve(
        [
            "--model", str(tiny_checkpoint),
            "--kv-cache-bytes", str(4 << 20),
            "--max-input-tokens", str(MAX_INPUT_TOKENS),
            "--max-model-len", "128",
            "--no-warmup",
        ]
    )  # fmt: skip


def _post(server: ServerProcess, path: str, content: bytes, **headers: str) -> httpx.Response:
    h = {"content-type": "application/json", **headers}
    return httpx.post(server.base_url + path, content=content, headers=h, timeout=120)


def _check(server: ServerProcess, r: httpx.Response, body: object) -> None:
    # A deadline the body asked for (timeout_s, queue_timeout_s) that passed is its answer (504).
    asked = isinstance(body, dict) and (body.get("timeout_s") or body.get("queue_timeout_s"))
    ok = r.status_code < 500 or (r.status_code == 504 and asked)
    assert ok, (body, r.status_code, r.text, server.log[-3000:])
    if r.status_code >= 400:
        assert "message" in r.json()["error"], r.text
    assert server.proc.poll() is None, server.log


ENDPOINTS = {
    "/v1/completions": _bodies(CompletionRequest),
    "/v1/chat/completions": _bodies(ChatCompletionRequest),
    "/tokenize": _bodies(TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": _bodies(DetokenizeRequest),
}


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_random_bodies_never_get_a_5xx(server: ServerProcess, path: str) -> None:
    @FUZZ
    @given(body=ENDPOINTS[path])
    def run(body: dict) -> None:
        if body.get("stream") is True:
            body["stream"] = False  # a stream's status is 200 before its content is checked
        raw = json.dumps(body).encode()
        _check(server, _post(server, path, raw), body)

    run()
    for get_path in ("/v1/models", "/health", "/ready", "/metrics"):
        assert httpx.get(server.base_url + get_path, timeout=30).status_code == 200


CASES = {
    "invalid utf-8": ("/v1/completions", b'{"prompt": "\xff\xfe\xfa"}', {400}),
    "not json": ("/v1/chat/completions", b"{not json", {400}),
    "json array": ("/v1/completions", b"[1, 2]", {400}),
    "negative max_tokens": ("/v1/completions", {"prompt": "a", "max_tokens": -1}, {400}),
    "huge max_tokens": ("/v1/completions", {"prompt": "a", "max_tokens": 10**30}, {400}),
    # Any temperature >= 0 is accepted (as vLLM does); it must just not break sampling.
    "huge temperature": ("/v1/completions", {"prompt": "a", "temperature": 1e308}, {200, 400}),
    "negative n": ("/v1/completions", {"prompt": "a", "n": -3}, {400}),
    "prompt is a number": ("/v1/completions", {"prompt": 12}, {400}),
    "messages is a string": ("/v1/chat/completions", {"messages": "hi"}, {400}),
    "empty prompt": ("/v1/completions", {"prompt": "", "max_tokens": 2}, {200, 400}),
    "1-token prompt": ("/v1/completions", {"prompt": "a", "max_tokens": 2}, {200}),
    "100k-token prompt": ("/v1/completions", {"prompt": "a" * 100_000, "max_tokens": 2}, {400}),
    "empty messages": ("/v1/chat/completions", {"messages": []}, {400}),
    "unknown role": (
        "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, {400}
    ),
    "huge token id": ("/detokenize", {"tokens": [2**70]}, {400}),
    "negative token id": ("/detokenize", {"tokens": [-1]}, {400}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_edge_cases(server: ServerProcess, name: str) -> None:
    path, body, expected = CASES[name]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = _post(server, path, raw)
    assert r.status_code in expected, (r.status_code, r.text)
    _check(server, r, body)


def test_a_20_mb_body_gets_413_and_the_server_lives(server: ServerProcess) -> None:
    raw = b'{"prompt": "' + b"a" * (20 << 20) + b'"}'
    try:
        r = _post(server, "/v1/completions", raw)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
    except httpx.HTTPError:
        pass  # the server may close the connection while the client is still sending
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
