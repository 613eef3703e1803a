"""Soak: a real `tidal serve` on the bundled model under bounded mixed traffic for TIDAL_SOAK_S
seconds (default 600) ends with flat RSS and an empty KV pool at idle, and no unexpected status.

Marked slow (CI deselects it). TIDAL_SOAK_REPORT=<path> writes the figures as JSON.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.tiny_server import ServerProcess
from tidal.bench.server_probe import tree_memory_bytes

SOAK_S = float(os.environ.get("TIDAL_SOAK_S", "600"))
# Warm-up traffic before the baseline: the allocator, torch's caches and the prefix cache settle.
WARMUP_S = min(60.0, max(10.0, SOAK_S / 10))
CONCURRENCY = 8
SAMPLE_EVERY_S = 2.0
IDLE_TIMEOUT_S = 300.0
# End-of-soak RSS (idle) may exceed the post-warm-up idle RSS by this much: 10% or 150 MB,
# whichever is larger. A leak per request outgrows it within minutes.
RSS_GROWTH_FRACTION = 0.10
RSS_GROWTH_BYTES = 150 << 20
KV_BYTES = str(64 << 20)
KINDS = ("short", "long_stream", "chat", "n2", "aborted_stream", "bad_request")
_LONG_TEXT = (
    "The tide comes in twice a day, pulled by the moon and, to a lesser degree, by the sun. "
    "Sailors, fishermen and engineers have measured it for centuries, and their tables still "
    "guide ships into narrow harbours at dawn. "
) * 6  # about 300 tokens


@dataclass(slots=True)
class Tally:
    """What the traffic saw, shared by the workers (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: Counter = field(default_factory=Counter)  # kind -> count
    statuses: Counter = field(default_factory=Counter)  # "kind status" -> count
    unexpected: list[dict] = field(default_factory=list)

    def record(self, kind: str, status: int | str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.requests[kind] += 1
            self.statuses[f"{kind} {status}"] += 1
            if not ok and len(self.unexpected) < 50:
                self.unexpected.append({"kind": kind, "status": status, "detail": detail[:300]})


def _tree_rss(pid: int) -> int:
    """RSS of the server process and its children (the engine process), in bytes."""
    memory = tree_memory_bytes(pid)
    assert memory is not None, f"server process {pid} is gone"
    return memory[0]


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def _wait_idle(base_url: str) -> dict[str, float]:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        m = _metrics(base_url)
        if m["tidal:num_requests_running"] == 0 and m["tidal:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server never went idle: {m}")
        time.sleep(0.2)


class Traffic:
    """One worker's requests: each kind checks its own expected status and body."""

    def __init__(self, base_url: str, tally: Tally, worker: int, seed: int) -> None:
        self.url = base_url
        self.tally = tally
        self.rng = random.Random(seed * 100 + worker)
        self.worker = worker
        self.session: list[dict] = []
        self.num_sessions = 0
        self.client = httpx.Client(timeout=300)
        self.num_sent = 0

    def one(self) -> None:
        kinds: list[tuple[Callable[[], None], float]] = [
            (self.short, 3), (self.long_stream, 2), (self.chat_session, 3), (self.n_choices, 1),
            (self.aborted_stream, 1), (self.bad_request, 1),
        ]  # fmt: skip
        if self.num_sent == 0:  # worker i starts with kind i: every kind runs in every phase
            fn = kinds[self.worker % len(kinds)][0]
        else:
            fn = self.rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        self.num_sent += 1
        fn()

    def _post(self, kind: str, path: str, body: dict, expect: int = 200) -> dict | None:
        try:
            r = self.client.post(self.url + path, json=body)
        except httpx.HTTPError as e:
            self.tally.record(kind, type(e).__name__, False, repr(e))
            return None
        self.tally.record(kind, r.status_code, r.status_code == expect, r.text)
        return r.json() if r.status_code == 200 else None

    def short(self) -> None:
        body = {"prompt": self.rng.choice(["Hi", "Once upon a time", "2 + 2 ="]),
                "max_tokens": self.rng.randint(1, 12), "temperature": 0.7}  # fmt: skip
        self._post("short", "/v1/completions", body)

    def n_choices(self) -> None:
        body = {"prompt": "Name a colour:", "max_tokens": 6, "n": 2, "temperature": 1.0}
        out = self._post("n2", "/v1/completions", body)
        if out is not None and len(out["choices"]) != 2:
            self.tally.record("n2", "choices", False, json.dumps(out))

    def _stream(self, kind: str, body: dict, stop_after: int | None) -> None:
        try:
            with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.tally.record(kind, r.status_code, False, r.read().decode())
                    return
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if stop_after is not None and len(lines) >= stop_after:
                            break  # leaving the block closes the connection: an abort
        except httpx.HTTPError as e:
            self.tally.record(kind, type(e).__name__, False, repr(e))
            return
        errors = [x for x in lines if '"error"' in x]
        if stop_after is None:
            ok = not errors and lines[-1:] == ["data: [DONE]"]
        else:
            ok = not errors
        self.tally.record(kind, 200, ok, "\n".join(lines[-2:]))

    def long_stream(self) -> None:
        body = {"prompt": _LONG_TEXT, "max_tokens": self.rng.randint(8, 24), "stream": True,
                "temperature": 0.8, "stream_options": {"include_usage": True}}  # fmt: skip
        self._stream("long_stream", body, None)

    def aborted_stream(self) -> None:
        body = {"prompt": "Tell me a story about the sea.", "max_tokens": 64, "stream": True,
                "ignore_eos": True}  # fmt: skip
        self._stream("aborted_stream", body, 2)

    def chat_session(self) -> None:
        # Up to 3 turns per session: each resends the history, which the prefix cache holds.
        if len(self.session) >= 6:
            self.session = []
            self.num_sessions += 1
        self.session.append({"role": "user", "content": self.rng.choice(
            ["Hello!", "What is a tide?", "Say it shorter.", "Thanks."])})  # fmt: skip
        body = {"messages": self.session, "max_completion_tokens": self.rng.randint(4, 16),
                "session_id": f"soak-{self.worker}-{self.num_sessions}"}  # fmt: skip
        out = self._post("chat", "/v1/chat/completions", body)
        reply = out["choices"][0]["message"]["content"] if out is not None else ""
        self.session.append({"role": "assistant", "content": reply or "..."})

    def bad_request(self) -> None:
        cases = [
            ({"prompt": "x", "temperature": -1}, "/v1/completions", 400),
            ({"messages": []}, "/v1/chat/completions", 400),
            ({"prompt": "x", "model": "no-such-model"}, "/v1/completions", 404),
            ({"messages": [{"role": "robot", "content": "hi"}]}, "/v1/chat/completions", 400),
        ]
        body, path, expect = self.rng.choice(cases)
        self._post("bad_request", path, body, expect)


def _drive(base_url: str, tally: Tally, duration_s: float, seed: int) -> None:
    deadline = time.monotonic() + duration_s

    def worker(i: int) -> None:
        traffic = Traffic(base_url, tally, i, seed)
        try:
            while time.monotonic() < deadline:
                traffic.one()
        finally:
            traffic.client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.slow
def test_soak_mixed_traffic_keeps_rss_flat_and_frees_the_kv_pool() -> None:
    server = ServerProcess(
        ["--kv-cache-bytes", KV_BYTES, "--max-num-seqs", str(CONCURRENCY)],
        startup_timeout_s=600,
    )
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            samples.append((round(time.monotonic() - t0, 1), _tree_rss(server.proc.pid)))
            stop.wait(SAMPLE_EVERY_S)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        server.wait_ready(timeout_s=600)
        sampler.start()
        warm = Tally()
        _drive(server.base_url, warm, WARMUP_S, seed=1)
        _wait_idle(server.base_url)
        rss_warm = _tree_rss(server.proc.pid)
        tally = Tally()
        _drive(server.base_url, tally, SOAK_S, seed=2)
        idle = _wait_idle(server.base_url)
        rss_end = _tree_rss(server.proc.pid)
        stop.set()
        sampler.join()
        tolerance = max(int(RSS_GROWTH_FRACTION * rss_warm), RSS_GROWTH_BYTES)
        report = {
            "soak_s": SOAK_S,
            "warmup_s": WARMUP_S,
            "concurrency": CONCURRENCY,
            "rss_idle_after_warmup_bytes": rss_warm,
            "rss_idle_end_bytes": rss_end,
            "rss_growth_bytes": rss_end - rss_warm,
            "rss_tolerance_bytes": tolerance,
            "rss_samples": samples,  # [seconds since start, bytes]
            "kv_cache_usage_ratio_idle": idle["tidal:kv_cache_usage_ratio"],
            "num_requests_running_idle": idle["tidal:num_requests_running"],
            "num_requests_waiting_idle": idle["tidal:num_requests_waiting"],
            "requests": dict(tally.requests),
            "statuses": dict(tally.statuses),
            "warmup_requests": sum(warm.requests.values()),
            "unexpected": warm.unexpected + tally.unexpected,
            "generation_tokens_total": idle["tidal:generation_tokens_total"],
            "prefix_cache_hit_tokens": idle["tidal:prefix_cache_hits_total"],
            "prefix_cache_query_tokens": idle["tidal:prefix_cache_queries_total"],
        }
        if path := os.environ.get("TIDAL_SOAK_REPORT"):
            Path(path).write_text(json.dumps(report, indent=1))
        mb = 1 << 20
        print(
            f"\nsoak {SOAK_S:g} s (+{WARMUP_S:g} s warm-up), {sum(tally.requests.values())} "
            f"requests {dict(tally.requests)}; RSS idle {rss_warm / mb:.0f} -> {rss_end / mb:.0f} "
            f"MiB ({(rss_end - rss_warm) / mb:+.0f}, tolerance {tolerance / mb:.0f}); KV usage "
            f"at idle {idle['tidal:kv_cache_usage_ratio']:g}; unexpected "
            f"{len(report['unexpected'])}"
        )
        assert report["unexpected"] == [], report["unexpected"]
        assert all(int(k.split()[1]) < 500 for k in tally.statuses if k.split()[1].isdigit())
        assert idle["tidal:kv_cache_usage_ratio"] == 0.0
        assert rss_end - rss_warm <= tolerance, report
        assert min(tally.requests[k] for k in KINDS) > 0, dict(tally.requests)
        for path in ("/health", "/ready"):
            assert httpx.get(server.base_url + path, timeout=30).status_code == 200
    finally:
        stop.set()
        server.stop()
