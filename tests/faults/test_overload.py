"""Overload: 200 concurrent requests against max_queue 32 on a real `tidal serve`: the excess gets
429 with a throughput-based Retry-After, the accepted ones finish, a deadline the queue cannot
meet is refused up front, and KV usage and the API process's memory return to idle."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx2 as httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.tiny_server import ServerProcess, serve
from tidal.server.guards import (
    MAX_RETRY_AFTER_S,
    MIN_RETRY_AFTER_S,
    clamp_retry_after_s,
    estimated_wait_s,
)

MAX_QUEUE = 32
MAX_NUM_SEQS = 2
NUM_CLIENTS = 200
MAX_TOKENS = 8
# Bounds that turn a hang into a failure; nothing asserts how long anything took.
DEADLINE_S = 120.0
# Growth of the API process's idle RSS from one 200-client storm to the next identical one. The
# first storm has already grown the arenas and buffers, so a healthy server stays well under
# this; a leak of ~250 KiB per request (a kept response, prompt or stream buffer) crosses it.
RSS_TOLERANCE_BYTES = 48 << 20


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    yield from serve(
        [
            "--model", str(tiny_checkpoint),
            "--kv-cache-bytes", str(4 << 20),
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-queue", str(MAX_QUEUE),
        ]
    )  # fmt: skip


def _metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value  # summed over labels
    return out


def _rss(server: ServerProcess) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def _body(prompt: str, **extra: object) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}  # fmt: skip


async def _storm(base_url: str, num_clients: int) -> list[tuple[int, dict[str, str], dict]]:
    """`num_clients` completions at once, each on its own connection: (status, headers, body)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int) -> tuple[int, dict[str, str], dict]:
            async with session.post(base_url + "/v1/completions", json=_body(f"Wave {i}")) as r:
                return r.status, dict(r.headers), await r.json()

        return await asyncio.gather(*(one(i) for i in range(num_clients)))


def test_retry_after_is_the_queue_over_the_finish_rate_clamped() -> None:
    assert estimated_wait_s(32, 8.0) == 4.0
    assert estimated_wait_s(32, None) is None
    assert estimated_wait_s(32, 0.0) is None
    assert clamp_retry_after_s(4.0) == 4.0
    assert clamp_retry_after_s(0.01) == MIN_RETRY_AFTER_S == 1.0
    assert clamp_retry_after_s(1e6) == MAX_RETRY_AFTER_S == 60.0
    assert clamp_retry_after_s(None) == 1.0


def test_200_clients_against_a_queue_of_32(server: ServerProcess) -> None:
    # The same storm first, so the idle figure already includes what a storm of this size grows
    # (Python's arenas, uvicorn's buffers, however many connections a loaded box keeps open at
    # once); the second one then adds only what requests leak.
    asyncio.run(_storm(server.base_url, NUM_CLIENTS))
    server.wait_until(
        lambda: _metrics(server)["tidal:num_requests_running"] == 0, "idle", DEADLINE_S
    )
    rss_idle = _rss(server)

    results = asyncio.run(_storm(server.base_url, NUM_CLIENTS))

    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    accepted = [body for status, _, body in results if status == 200]
    rejected = [(headers, body) for status, headers, body in results if status == 429]
    # At most MAX_NUM_SEQS run and MAX_QUEUE wait at any moment, so most of 200 are refused.
    assert len(rejected) >= 1 and len(accepted) >= MAX_NUM_SEQS + 1
    for body in accepted:
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    for headers, body in rejected:
        assert body["error"]["code"] == "queue_full"
        assert MIN_RETRY_AFTER_S <= int(headers["Retry-After"]) <= MAX_RETRY_AFTER_S

    server.wait_until(
        lambda: (
            (m := _metrics(server))["tidal:kv_cache_usage_ratio"] == 0.0
            and m["tidal:num_requests_running"] == 0
            and m["tidal:num_requests_waiting"] == 0
        ),
        "KV usage back to 0",
        DEADLINE_S,
    )
    m = _metrics(server)
    assert m["tidal:request_rejected_total"] >= len(rejected)
    rss_after = _rss(server)
    print(f"API process RSS: idle {rss_idle >> 20} MiB, after {NUM_CLIENTS} clients "
          f"{rss_after >> 20} MiB")  # fmt: skip
    assert rss_after <= rss_idle + RSS_TOLERANCE_BYTES
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_a_deadline_the_queue_cannot_meet_is_refused_up_front(server: ServerProcess) -> None:
    async def scenario() -> tuple[int, dict[str, str], dict]:
        # Fill the queue, then ask for a deadline far shorter than the wait behind it.
        storm = asyncio.ensure_future(_storm(server.base_url, MAX_NUM_SEQS + MAX_QUEUE))
        await asyncio.to_thread(
            server.wait_until,
            lambda: _metrics(server)["tidal:num_requests_waiting"] >= MAX_QUEUE // 2,
            "a long queue",
            DEADLINE_S,
        )
        async with aiohttp.ClientSession() as session:
            body = _body("Late", timeout_s=0.001)
            async with session.post(server.base_url + "/v1/completions", json=body) as r:
                result = r.status, dict(r.headers), await r.json()
        await storm
        return result

    # The finish rate is known: the earlier test (or this storm) finished many requests.
    asyncio.run(_storm(server.base_url, 4))
    status, headers, body = asyncio.run(scenario())
    assert status == 429, body
    assert body["error"]["code"] == "deadline_unmeetable"
    assert body["error"]["param"] == "timeout_s"
    assert "cannot finish within its deadline of 0.001 s" in body["error"]["message"]
    assert MIN_RETRY_AFTER_S <= int(headers["Retry-After"]) <= MAX_RETRY_AFTER_S
