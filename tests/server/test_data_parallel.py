"""`tidal serve --data-parallel 2` on the tiny model, driven by the openai SDK: sessions stay on
their replica and hit its prefix cache, a shared system prompt goes where it is cached, and greedy
outputs through the router equal a single engine's; a SIGKILLed replica's waiting requests finish on
the other and it comes back. Which replica served a request is read from
the per-replica counters in /metrics (requests here are sequential, so each delta is one request)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY
from tests.server.tiny_server import ServerProcess, serve

KV_BYTES = str(4 << 20)
NAME = "tiny"
ARGS = ["--kv-cache-bytes", KV_BYTES, "--served-model-name", NAME]


@pytest.fixture(scope="module")
def dp_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    yield from serve(["--model", str(tiny_checkpoint), *ARGS, "--data-parallel", "2"])


def client(server: ServerProcess, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=api_key, timeout=120, max_retries=0
    )


def replica_counters(server: ServerProcess) -> dict[tuple[str, str], float]:
    """(metric, replica) -> value for the per-replica counters; router decisions by reason."""
    out: dict[tuple[str, str], float] = {}
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "replica" not in s.labels or s.name.endswith("_created"):
                continue
            name = s.name
            if "reason" in s.labels:
                name = f"{name}:{s.labels['reason']}"
            out[(name, s.labels["replica"])] = s.value
    return out


def served_by(before: dict, after: dict) -> tuple[str, float]:
    """The one replica whose prefix-cache lookups grew, and how many tokens it found cached."""
    grew = [
        r for r in ("0", "1")
        if after[("tidal:prefix_cache_queries_total", r)]
        > before[("tidal:prefix_cache_queries_total", r)]
    ]  # fmt: skip
    assert len(grew) == 1, (before, after)
    r = grew[0]
    key = ("tidal:prefix_cache_hits_total", r)
    return r, after[key] - before[key]


def chat(server: ServerProcess, messages: list[dict], session_id: str | None = None) -> str:
    extra = {"session_id": session_id} if session_id is not None else {}
    r = client(server).chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )
    return r.choices[0].message.content or ""


def test_health_lists_both_replicas(dp_server: ServerProcess) -> None:
    body = httpx.get(dp_server.base_url + "/health", timeout=30).json()
    assert body["status"] == "ok"
    assert [(r["replica"], r["up"]) for r in body["replicas"]] == [(0, True), (1, True)]
    assert body["replicas"][0]["pid"] != body["replicas"][1]["pid"]


def test_sessions_stay_on_their_replica_and_hit_its_cache(dp_server: ServerProcess) -> None:
    sessions = [f"session-{k}" for k in range(8)]
    # Distinct openings (so no turn-1 prompt shares more than the template's first block).
    history = {
        s: [{"role": "user", "content": f"{k} Tell me, about the tide number {k}, in some detail."}]
        for k, s in enumerate(sessions)
    }
    home: dict[str, str] = {}
    for turn in range(2):
        for s in sessions:  # interleaved: every session's turn before anyone's next
            before = replica_counters(dp_server)
            reply = chat(dp_server, history[s], s)
            after = replica_counters(dp_server)
            replica, hit_tokens = served_by(before, after)
            if turn == 0:
                home[s] = replica
            else:
                assert replica == home[s], f"{s} moved from {home[s]} to {replica}"
                assert hit_tokens > 0, f"{s}'s second turn found nothing cached"
                key = ("tidal:router_decisions_total:session", replica)
                assert after[key] == before.get(key, 0) + 1
            history[s] += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "And then?"},
            ]
    assert sorted(set(home.values())) == ["0", "1"]  # the sessions were spread over both


def test_openai_prompt_cache_key_routes_as_a_session(dp_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "9 Where does the tide go, in some detail?"}]
    c = client(dp_server)
    for turn in range(2):
        before = replica_counters(dp_server)
        r = c.chat.completions.create(
            model=NAME, messages=messages, max_tokens=6, temperature=0, prompt_cache_key="chat-9"
        )
        after = replica_counters(dp_server)
        replica, _ = served_by(before, after)
        if turn == 1:  # the key's second request goes home as a session's does
            key = ("tidal:router_decisions_total:session", replica)
            assert after[key] == before.get(key, 0) + 1
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": "And then?"},
        ]


def test_shared_system_prompt_is_routed_where_it_is_cached(dp_server: ServerProcess) -> None:
    system = {"role": "system", "content": "You are a harbour master. " * 6}  # ~10 blocks
    before = replica_counters(dp_server)
    chat(dp_server, [system, {"role": "user", "content": "When is high water?"}])
    first, _ = served_by(before, replica_counters(dp_server))
    for question in ("Is the pier open?", "How deep is the channel?", "Any storms?"):
        before = replica_counters(dp_server)
        chat(dp_server, [system, {"role": "user", "content": question}])
        after = replica_counters(dp_server)
        replica, hit_tokens = served_by(before, after)
        assert replica == first
        assert hit_tokens >= 16 * 8  # the system prompt's blocks, at least
        key = ("tidal:router_decisions_total:prefix", replica)
        assert after[key] == before.get(key, 0) + 1


PROMPTS = [f"The tide {k} rises and" for k in range(4)]


def completions(
    server: ServerProcess, prompts: list[str] = PROMPTS, api_key: str = "none"
) -> list[str]:
    def one(prompt: str) -> str:
        r = client(server, api_key).completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_greedy_outputs_through_the_router_equal_a_single_engines(
    dp_server: ServerProcess, server: ServerProcess
) -> None:
    """`server` is conftest's single-engine server on the same checkpoint (its auth and prompt
    limits do not change greedy outputs)."""
    before = replica_counters(dp_server)
    routed = completions(dp_server)
    after = replica_counters(dp_server)
    for r in ("0", "1"):  # concurrent requests went to both replicas
        key = ("tidal:prefix_cache_queries_total", r)
        assert after[key] > before[key]
    assert completions(server, api_key=API_KEY) == routed


def test_sigkill_of_one_replica_moves_its_waiting_requests_and_it_returns(
    dp_server: ServerProcess,
) -> None:
    """Last in this module: it restarts replica 1. Its engine is SIGSTOPped first, so the
    requests routed to it are held there by construction (none can start), then SIGKILLed: every
    one of them must finish on replica 0, and replica 1 must come back and serve."""
    replicas = httpx.get(dp_server.base_url + "/health", timeout=30).json()["replicas"]
    victim = replicas[1]["pid"]
    key = ("tidal:router_decisions_total:load", "1")  # new prompts: routed by load
    sent_before = replica_counters(dp_server).get(key, 0)
    prompts = [f"A storm {k} comes in and" for k in range(4)]
    os.kill(victim, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(completions, dp_server, prompts)
            # Least load sends some of them to the stopped replica, where they wait: half when
            # the four arrive together, one when a busy machine staggers them and replica 0
            # finishes each before the next comes (the full suite on 2 cores did).
            dp_server.wait_until(
                lambda: replica_counters(dp_server).get(key, 0) >= sent_before + 1,
                "requests routed to replica 1",
                timeout_s=60,
            )
            os.kill(victim, signal.SIGKILL)
            texts = pending.result(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert len(texts) == len(prompts) and all(texts)  # none lost: all ran on replica 0
    assert "waiting requests moved to the others" in dp_server.log

    def back() -> bool:
        r = httpx.get(dp_server.base_url + "/health", timeout=30).json()["replicas"][1]
        return r["up"] and r["pid"] != victim

    dp_server.wait_until(back, "replica 1 restarting", timeout_s=120)
    m = replica_counters(dp_server)
    assert m[("tidal:engine_restarts_total", "1")] == 1
    assert m[("tidal:engine_restarts_total", "0")] == 0
    before = m[("tidal:prefix_cache_queries_total", "1")]
    completions(dp_server, [f"Calm {k} water and" for k in range(4)])  # spread over both again
    assert replica_counters(dp_server)[("tidal:prefix_cache_queries_total", "1")] > before
