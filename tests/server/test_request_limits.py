"""Limits a server needs, over HTTP with the openai SDK against real `tidal serve` processes:
server.max_n and server.max_total_output_tokens (400 naming the parameter and the limit),
queue_timeout_s as a request field and a config key (504 `queue_timeout` for a request still
queued when it passes), and the warm-up state in /health."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.server.conftest import API_KEY, KV_BYTES
from tests.server.tiny_server import ServerProcess, serve

MAX_N = 2
# Room for one request running to the tiny model's 256-token context (the seat holder below).
MAX_TOTAL = 250


@pytest.fixture(scope="module")
def strict_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    """One seat, at most 2 choices and 250 output tokens a request, a 50 ms default queue timeout."""
    yield from serve(
        [
            "--model", str(tiny_checkpoint),
            "--kv-cache-bytes", KV_BYTES,
            "--max-num-seqs", "1",
            "--max-n", str(MAX_N),
            "--max-total-output-tokens", str(MAX_TOTAL),
            "--queue-timeout-s", "0.05",
            "--no-warmup",
        ]
    )  # fmt: skip


def _client(server: ServerProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.base_url + "/v1", max_retries=0, timeout=60)


@contextmanager
def _seat_taken(client: openai.OpenAI) -> Iterator[None]:
    """Hold the only running seat with a streamed request that runs to the context limit; it is
    aborted (the stream closed) on exit. Its first chunk means it is running."""
    stream = client.completions.create(
        model=None, prompt="Hold the seat", max_tokens=None, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # type: ignore[call-overload]  # fmt: skip
    try:
        next(iter(stream))
        yield
    finally:
        stream.close()


def _expect_queue_timeout(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == 504, e.value
    body = e.value.body
    assert isinstance(body, dict) and body["code"] == "queue_timeout", body
    assert body["param"] == "queue_timeout_s" and "queue timeout" in body["message"]
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_queue_timeout_s_request_field_ends_a_queued_request(narrow_server: ServerProcess) -> None:
    client = _client(narrow_server)
    with _seat_taken(client):
        short = {"queue_timeout_s": 0.001, "ignore_eos": True}
        _expect_queue_timeout(
            lambda: client.completions.create(
                model=None, prompt="Wait", max_tokens=4, extra_body=short
            )  # type: ignore[call-overload]
        )
        # Streamed, the error comes before the first output, so it keeps its status.
        _expect_queue_timeout(
            lambda: list(
                client.chat.completions.create(
                    model=None,
                    messages=[{"role": "user", "content": "Wait"}],
                    max_tokens=4,
                    stream=True,
                    extra_body=short,
                )  # type: ignore[call-overload]  # fmt: skip
            )
        )
    # Without a queue timeout the next request waits its turn and is served in full.
    out = client.completions.create(
        model=None, prompt="After", max_tokens=4, extra_body={"ignore_eos": True}
    )  # type: ignore[call-overload]
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


def test_bad_queue_timeout_s_is_400(server: ServerProcess) -> None:
    client = _client(server, API_KEY)
    for bad in (0, -1.5, "soon"):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model="tiny", prompt="x", max_tokens=1, extra_body={"queue_timeout_s": bad}
            )
        assert e.value.body["param"] == "queue_timeout_s", e.value.body  # type: ignore[index]


def test_server_queue_timeout_s_is_the_default_and_a_request_may_only_shorten_it(
    strict_server: ServerProcess,
) -> None:
    client = _client(strict_server)
    with _seat_taken(client):
        for extra in ({}, {"queue_timeout_s": 600}):
            _expect_queue_timeout(
                lambda extra=extra: client.completions.create(
                    model=None, prompt="Wait", max_tokens=4, extra_body=extra
                )  # type: ignore[call-overload]
            )


def test_n_over_server_max_n_is_400(server: ServerProcess, strict_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _client(server, API_KEY).completions.create(model="tiny", prompt="x", max_tokens=1, n=17)
    assert e.value.body["param"] == "n" and "[1, 16]" in e.value.body["message"]  # type: ignore[index]
    assert "server.max_n" in e.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        _client(strict_server).chat.completions.create(
            model=None, messages=[{"role": "user", "content": "x"}], max_tokens=1, n=MAX_N + 1
        )  # type: ignore[call-overload]
    assert e.value.body["param"] == "n" and f"[1, {MAX_N}]" in e.value.body["message"]  # type: ignore[index]


def test_n_times_max_tokens_over_the_cap_is_400(
    server: ServerProcess, strict_server: ServerProcess
) -> None:
    client = _client(strict_server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=None, prompt="x", max_tokens=130, n=2)  # type: ignore[call-overload]
    body = e.value.body
    assert body["param"] == "max_tokens" and "up to 260 output tokens" in body["message"]  # type: ignore[index]
    assert f"the {MAX_TOTAL} one request" in body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": "x"}], max_completion_tokens=126, n=2
        )  # type: ignore[call-overload]
    assert e.value.body["param"] == "max_completion_tokens"  # type: ignore[index]
    # A prompt list multiplies too: 3 prompts x 1 choice x 90 tokens.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=None, prompt=["a", "b", "c"], max_tokens=90)  # type: ignore[call-overload]
    assert "3 prompts x n=1" in e.value.body["message"]  # type: ignore[index]
    # The default cap is the context length (256 tokens for the tiny model).
    main = _client(server, API_KEY)
    with pytest.raises(openai.BadRequestError) as e:
        main.completions.create(model="tiny", prompt="x", max_tokens=200, n=2)
    assert "more than the 256 one request" in e.value.body["message"]  # type: ignore[index]
    out = main.completions.create(
        model="tiny", prompt="x", max_tokens=4, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 8


def test_health_reports_the_warm_up(server: ServerProcess, strict_server: ServerProcess) -> None:
    warm = httpx.get(server.base_url + "/health", timeout=30).json()
    assert warm == {"status": "ok", "warmup": {"status": "ok", "failed_attempts": 0}}
    off = httpx.get(strict_server.base_url + "/health", timeout=30).json()
    assert off["warmup"] == {"status": "off", "failed_attempts": 0}
