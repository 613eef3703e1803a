"""Load generator: replays a trace against an OpenAI-compatible endpoint, open loop or closed loop."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.bench.run_stats import SLO, RunStats, compute_stats
from tidal.bench.server_probe import ServerProbe
from tidal.bench.stream_client import RequestOptions, RequestRecord, StreamClient
from tidal.bench.trace import TraceRequest

_WARMUP_PROMPT = "Warm up: say something short about the sea."


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Open loop at `rate` requests/s (math.inf: all at once), or closed loop with `concurrency`
    requests in flight. `burstiness` is the gamma shape of inter-arrival gaps: 1 is Poisson,
    below 1 burstier, above 1 more regular."""

    rate: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError(
                f"load rate={self.rate} concurrency={self.concurrency} is invalid: "
                "expected exactly one of a request rate or a concurrency"
            )
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"request_rate={self.rate} is invalid: expected a rate > 0 or inf")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} is invalid: expected an integer >= 1")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(
                f"burstiness={self.burstiness} is invalid: expected a finite value > 0"
            )

    @property
    def label(self) -> str:
        return (
            f"rate={self.rate:g}/s" if self.rate is not None else f"concurrency={self.concurrency}"
        )


def arrival_times(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of an open-loop run: gamma gaps with mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        # Gamma(shape k, scale 1/(rate k)) has mean 1/rate for every k; k=1 is exponential.
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


@dataclass(slots=True)
class RunConfig:
    """Everything about a run but the load."""

    base_url: str
    options: RequestOptions
    seed: int = 0
    num_warmup: int = 1
    slo: SLO = SLO()
    target: str = "target"
    server_pid: int | None = None  # sample this process tree's RSS
    probe_interval_s: float = 0.5
    progress: bool = True
    request_timeout_s: float = 600.0


async def resolve_model(base_url: str, api_key: str | None = None) -> str:
    """The first id of GET /v1/models (for runs that were not told the model name)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            data = (await resp.json())["data"]
    if not data:
        raise ValueError(f"base_url={base_url!r} is invalid: /v1/models lists no model")
    return str(data[0]["id"])


async def run_load(
    cfg: RunConfig, trace: Sequence[TraceRequest], load: LoadSpec
) -> tuple[RunStats, list[RequestRecord]]:
    """One run: warm-up (not recorded), then the whole trace under `load`, with the probe sampling."""
    import aiohttp

    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    # One pooled session: keep-alive connections, no per-request TCP/handshake cost in TTFT.
    # Idle connections are dropped after 4 s, before servers close them (llama-server's HTTP
    # library closes after 5 s): reusing one the server closed fails the request before it is sent.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = StreamClient(cfg.base_url, cfg.options, clock, session)
        for i in range(cfg.num_warmup):
            warm = _warmup_request(trace, i)
            rec = await client.send(warm, RequestRecord(-1 - i, clock()))
            if rec.error:
                raise RuntimeError(f"warm-up request to {cfg.base_url} failed: {rec.error}")
        probe = ServerProbe(session, cfg.base_url, clock, cfg.server_pid, cfg.probe_interval_s)
        probe_task = asyncio.create_task(probe.run())
        t0 = clock()
        records = await _replay(client, trace, load, cfg, t0)
        probe.stop()
        await probe_task
    sent = [r.sent_s for r in records]
    duration = max(r.finished_s for r in records) - min(sent) if records else 0.0
    stats = compute_stats(
        cfg.target,
        records,
        duration,
        cfg.slo,
        offered_rate=load.rate,
        concurrency=load.concurrency,
        server=probe.summary(),
    )
    return stats, records


def _warmup_request(trace: Sequence[TraceRequest], i: int) -> TraceRequest:
    prompt = f"{_WARMUP_PROMPT} ({i})"
    if trace and all(r.is_chat for r in trace):
        return TraceRequest(-1 - i, 8, messages=(("user", prompt),))
    return TraceRequest(-1 - i, 8, prompt=prompt)


async def _replay(
    client: StreamClient, trace: Sequence[TraceRequest], load: LoadSpec, cfg: RunConfig, t0: float
) -> list[RequestRecord]:
    from tqdm import tqdm

    bar = tqdm(
        total=len(trace), desc=f"{cfg.target} {load.label}", file=sys.stderr,
        disable=not cfg.progress, unit="req", leave=False,
    )  # fmt: skip
    # A turn waits for the previous turn of its session: its prompt carries that turn's history.
    done: dict[int, asyncio.Event] = {r.index: asyncio.Event() for r in trace}
    previous: dict[int, int] = {}
    last_of_session: dict[int, int] = {}
    for r in trace:
        if r.session is not None:
            if r.session in last_of_session:
                previous[r.index] = last_of_session[r.session]
            last_of_session[r.session] = r.index
    records: dict[int, RequestRecord] = {}

    async def one(req: TraceRequest, scheduled_s: float) -> None:
        try:
            if req.index in previous:
                await done[previous[req.index]].wait()
            rec = RequestRecord(req.index, scheduled_s)
            records[req.index] = await client.send(req, rec)
        finally:
            done[req.index].set()
            bar.update(1)

    try:
        if load.rate is not None:
            times = arrival_times(len(trace), load.rate, load.burstiness, cfg.seed)
            tasks = []
            for req, at in zip(trace, times):
                delay = t0 + at - client.clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req, t0 + at)))
            await asyncio.gather(*tasks)
        else:
            queue: asyncio.Queue[TraceRequest] = asyncio.Queue()
            for req in trace:
                queue.put_nowait(req)

            async def worker() -> None:
                while not queue.empty():
                    req = queue.get_nowait()
                    await one(req, client.clock())

            assert load.concurrency is not None  # LoadSpec guarantees one of the two
            await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    finally:
        bar.close()
    return [records[r.index] for r in trace]


def run_sweep(
    cfg: RunConfig, traces: Sequence[Sequence[TraceRequest]], loads: Sequence[LoadSpec]
) -> list[tuple[RunStats, list[RequestRecord]]]:
    """One run per load, in order, load i replaying traces[i], each printing its one-line summary
    to stderr. Distinct traces per load keep one run's prompts out of the next run's prefix cache
    (the server stays up across the sweep); every target replays the same list."""
    if len(traces) != len(loads):
        raise ValueError(f"{len(traces)} traces for {len(loads)} loads: expected one per load")
    out = []
    for trace, load in zip(traces, loads, strict=True):
        stats, records = asyncio.run(run_load(cfg, trace, load))
        print(stats.line(), file=sys.stderr, flush=True)
        out.append((stats, records))
    return out
