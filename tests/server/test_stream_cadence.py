"""Streaming cadence and SLO accounting: server.stream_interval_ms coalesces a stream's deltas,
SSE keep-alive comments while a request is queued, and the tidal:slo_* / scheduler gauges."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import KV_BYTES
from tests.server.tiny_server import ServerProcess, serve
from tidal.engine.output import CompletionOutput, Logprob, RequestDelta, RequestMetrics
from tidal.engine.stats import StepStats
from tidal.server.errors import APIError, queue_full
from tidal.server.generation import merge_deltas, open_stream
from tidal.server.metrics import ServerMetrics


def _out(text: str, ids: list[int], finish: str | None = None, lp: bool = False) -> RequestDelta:
    logprobs = [{t: Logprob(-0.5, 1, None)} for t in ids] if lp else None
    choice = CompletionOutput(0, text, ids, None, logprobs, finish, None)
    return RequestDelta("r", [choice], finish is not None, num_prompt_tokens=2)


def test_merge_deltas_concatenates_text_tokens_and_logprobs() -> None:
    merged = merge_deltas(_out("a", [5], lp=True), _out("bc", [6, 7], "length", lp=True))
    (c,) = merged.outputs
    assert (c.text, c.token_ids, c.finish_reason, merged.finished) == (
        "abc",
        [5, 6, 7],
        "length",
        True,
    )
    assert [list(e) for e in c.logprobs] == [[5], [6], [7]]


async def _outs(
    items: list[tuple[int, RequestDelta] | APIError], gate: asyncio.Event
) -> AsyncIterator:
    await gate.wait()
    for item in items:
        if isinstance(item, APIError):
            raise item
        yield item


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_keepalive_comments_while_queued_then_the_stream() -> None:
    async def main() -> list[bytes]:
        gate = asyncio.Event()
        outs = _outs([(0, _out("hi", [3]))], gate)
        body = await open_stream(outs, 0.001, lambda first: _body(first, outs))
        chunks = []
        async for chunk in body:
            chunks.append(chunk)
            if len(chunks) == 3:  # two keep-alives seen: the request leaves the queue now
                gate.set()
        return chunks

    async def _body(first, rest) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
        yield f"first {first[1].outputs[0].text}".encode()

    chunks = _run(main())
    assert chunks[:3] == [b": queued\n\n"] * 3 and chunks[3] == b"first hi"


def test_no_keepalive_when_the_first_output_is_quick_and_errors_keep_their_status() -> None:
    async def quick() -> list[bytes]:
        gate = asyncio.Event()
        gate.set()
        outs = _outs([(0, _out("hi", [3]))], gate)
        body = await open_stream(outs, 60.0, lambda first: _one(first))
        return [c async for c in body]

    async def _one(first) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
        yield b"x"

    assert _run(quick()) == [b"x"]

    async def refused() -> None:
        gate = asyncio.Event()
        gate.set()
        await open_stream(_outs([queue_full(1, 1.0)], gate), 60.0, lambda first: _one(first))

    with pytest.raises(APIError) as e:
        _run(refused())
    assert e.value.status == 429


def test_error_after_keepalive_goes_into_the_stream() -> None:
    async def main() -> list[bytes]:
        gate = asyncio.Event()
        outs = _outs([queue_full(1, 1.0)], gate)
        body = await open_stream(outs, 0.001, lambda first: _never(first))
        chunks = []
        async for chunk in body:
            chunks.append(chunk)
            gate.set()
        return chunks

    async def _never(first) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
        raise AssertionError("no output came")
        yield b""

    chunks = _run(main())
    assert chunks[0] == b": queued\n\n"
    assert b'"error"' in chunks[-2] and chunks[-1] == b"data: [DONE]\n\n"


def _stats(**kw: object) -> StepStats:
    base = dict(
        num_scheduled_tokens=20, token_budget=80, batch_utilization=0.25, seat_utilization=0.5,
        seat_cap=8, prefill_budget=76, budget_reason="tpot", num_scheduled_seqs=5,
        num_decode_seqs=4, num_prefill_seqs=1, num_running=4, num_waiting=2, num_preempted=0,
        num_preemptions_total=0, kv_usage=0.1, num_free_blocks=10, prefix_queried_tokens=0,
        prefix_hit_tokens=0, prefix_queried_tokens_total=0, prefix_hit_tokens_total=0,
        evictions_by_reason=(), step_time_s=0.14, predicted_step_s=0.15, num_prefill_tokens=16,
        attended_keys=900, cost_coefficients=(0.01, 0.002, 0.005, 0.0003), headroom=0.9,
    )  # fmt: skip
    base.update(kw)
    return StepStats(**base)  # type: ignore[arg-type]


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_slo_attainment_goodput_and_controller_gauges() -> None:
    metrics = ServerMetrics(target_ttft_ms=1000, target_tpot_ms=100)
    metrics.on_step(_stats())

    def finish(ttft_s: float, tpot_s: float, n: int = 5) -> None:
        tracker = metrics.track()
        first, last = 10.0 + ttft_s, 10.0 + ttft_s + tpot_s * (n - 1)
        out = _out("x" * n, list(range(n)), "length")
        out.metrics = RequestMetrics(10.0, 10.0, first, last, last, 2, n, 0, 0)
        tracker.update(out)

    finish(0.5, 0.05)  # meets both
    finish(2.0, 0.05)  # late first token
    finish(0.5, 0.30)  # slow decode
    finish(0.5, 0.05, n=1)  # one token: no TPOT to miss
    s = _samples(metrics)
    assert s[("tidal:slo_attainment", (("slo", "ttft"),))] == 0.75
    assert s[("tidal:slo_attainment", (("slo", "tpot"),))] == 0.75
    assert s[("tidal:slo_requests_total", (("result", "missed"), ("slo", "tpot")))] == 1
    assert s[("tidal:goodput_requests_total", ())] == 2
    assert s[("tidal:scheduler_token_budget", ())] == 80
    assert s[("tidal:scheduler_seat_cap", ())] == 8
    assert s[("tidal:scheduler_headroom", ())] == 0.9
    assert s[("tidal:step_cost_seconds", (("term", "per_decode_seq"),))] == 0.005
    assert s[("tidal:seat_utilization_count", ())] == 1


def test_no_targets_no_slo_series() -> None:
    metrics = ServerMetrics()
    out = _out("xy", [1, 2], "length")
    out.metrics = RequestMetrics(0.0, 0.0, 0.1, 0.2, 0.2, 2, 2, 0, 0)
    metrics.track().update(out)
    assert not [k for k in _samples(metrics) if k[0].startswith("tidal:slo")]


@pytest.fixture(scope="module")
def coalescing_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    """Streams send the first token at once, then at most one chunk per 10 minutes: the rest
    arrives merged with the finish."""
    yield from serve(
        [
            "--model", str(tiny_checkpoint),
            "--kv-cache-bytes", KV_BYTES,
            "--stream-interval-ms", "600000",
            "--served-model-name", "tiny",
            "--no-warmup",
        ]
    )  # fmt: skip


def _events(resp: httpx.Response) -> list[dict]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_stream_interval_coalesces_deltas(coalescing_server: ServerProcess) -> None:
    url = coalescing_server.base_url + "/v1/completions"
    body = {
        "model": "tiny",
        "prompt": "abc",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    streamed = httpx.post(url, json={**body, "stream": True}, timeout=60)
    events = _events(streamed)
    # The first token at once, then the other 11 merged into the finishing chunk.
    assert len(events) == 2, events
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events) == whole
