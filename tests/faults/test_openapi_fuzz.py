"""schemathesis against a live tiny `tidal serve`'s /openapi.json: every public operation gets
bounded, derandomized positive (schema-valid) and negative (schema-breaking) requests and never
answers 5xx (nor a stream's in-band 5xx error event); the server still answers afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.server.tiny_server import ServerProcess, serve

# Bounded: 20 examples per operation and mode, no example database; derandomized, so the same
# ones every run under one PYTHONHASHSEED (schemathesis draws differ between hash seeds).
FUZZ = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
OPERATIONS = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /health",
    "GET /ready",
    "GET /metrics",
    "GET /version",
]
_POSTS = [op for op in OPERATIONS if op.startswith("POST")]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    # A short context bounds every generation (a null max_tokens runs to the context limit).
    yield from serve(
        [
            "--model", str(tiny_checkpoint),
            "--kv-cache-bytes", str(4 << 20),
            "--max-input-tokens", "48",
            "--max-model-len", "64",
            "--no-warmup",
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def operations(server: ServerProcess) -> dict[str, schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    ops = {}
    for result in schema.get_all_operations():
        op = result.ok()
        ops[f"{op.method.upper()} {op.path}"] = op
    return ops


def test_the_schema_describes_every_public_operation(
    operations: dict[str, schemathesis.APIOperation], server: ServerProcess
) -> None:
    assert sorted(operations) == sorted(OPERATIONS)
    doc = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert doc["paths"]["/v1/completions"]["post"]["responses"]["503"]["content"][
        "application/json"
    ]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    # The docs UI stays off.
    assert httpx.get(server.base_url + "/docs", timeout=30).status_code == 404


def _check(server: ServerProcess, case: schemathesis.Case, status: int, text: str) -> None:
    sent = case.body if isinstance(case.body, dict) else {}
    where = f"{case.method} {case.path} {json.dumps(sent, default=repr)[:500]}"
    if status == 504:
        # A deadline the client asked for (timeout_s, or queue_timeout_s to start by) that passed
        # is its own answer, not a fault.
        field = {"deadline_exceeded": "timeout_s", "queue_timeout": "queue_timeout_s"}
        code = json.loads(text)["error"]["code"]
        assert code in field and sent.get(field[code]) is not None, (where, text)
    else:
        assert status < 500, (where, status, text, server.log[-3000:])
    # A stream's status is sent before generation: a fault shows as an in-band error event.
    assert '"code":"internal_error"' not in text, (where, text)
    assert server.proc.poll() is None, server.log


def _fuzz(server: ServerProcess, op: schemathesis.APIOperation, mode: GenerationMode) -> list[int]:
    """Every status the operation answered while fuzzed."""
    statuses: list[int] = []

    @FUZZ
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.base_url, timeout=120)
        statuses.append(response.status_code)
        _check(server, case, response.status_code, response.text)

    run()
    return statuses


def _example(doc: dict, name: str) -> dict:
    method, path = name.split(" ")
    return doc["paths"][path][method.lower()]["requestBody"]["content"]["application/json"][
        "example"
    ]


@pytest.mark.parametrize("name", OPERATIONS)
def test_schema_valid_requests_never_get_a_5xx(
    server: ServerProcess, operations: dict[str, schemathesis.APIOperation], name: str
) -> None:
    op = operations[name]
    if name.startswith("POST"):
        # Some schema-valid bodies still get 400 (a Gemma chat must alternate roles; a prompt
        # may outgrow the context), but the schema's own example must be served.
        doc = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
        response = op.Case(body=_example(doc, name)).call(base_url=server.base_url, timeout=120)
        assert response.status_code == 200, response.text
    _fuzz(server, op, GenerationMode.POSITIVE)


@pytest.mark.parametrize("name", _POSTS)
def test_schema_breaking_requests_never_get_a_5xx(
    server: ServerProcess, operations: dict[str, schemathesis.APIOperation], name: str
) -> None:
    statuses = _fuzz(server, operations[name], GenerationMode.NEGATIVE)
    assert all(400 <= s < 500 for s in statuses), sorted(statuses)


def test_the_server_answers_after_the_fuzzing(server: ServerProcess) -> None:
    for path in ("/health", "/ready", "/v1/models", "/metrics"):
        assert httpx.get(server.base_url + path, timeout=30).status_code == 200, path
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
