"""The Ray Serve application: tidal's OpenAI server as the ingress, each engine replica a deployment, routed by session and cached prefix.

    serve run tidal.serving.ray:app        # settings from TIDAL_<SECTION>_<KEY> (and TIDAL_CONFIG)
    tidal serve --ray [--data-parallel N] [--ray-max-replicas M]

Two deployments: `TidalServer`, the ingress, runs the very FastAPI app `tidal serve` runs
(`server.app.build_app`) with a `RayEngineClient`; `TidalEngine` holds one EngineCore on a
thread of its replica (Ray Serve restarts a replica that dies; the ingress reruns the requests
it had not started). Calls from the ingress to the engines go through `TidalRequestRouter`,
the same RoutingPolicy as `--data-parallel` on one machine. With a maximum replica count the
engine deployment autoscales on its queue (running + waiting per replica against
batching.max_num_seqs) and scales up while the replicas' KV is nearly full
(`scale_on_queue_and_kv`). Each engine replica reserves hardware.threads CPUs (default 1) and
runs that many torch threads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

try:
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
except ImportError as e:  # the optional extra
    raise ImportError(
        "tidal's Ray Serve application needs Ray Serve: pip install 'tidal[ray]' "
        f"(importing ray failed: {e})"
    ) from None

from tidal.config.engine import EngineConfig, TidalConfig
from tidal.engine.messages import AddRequest, EngineReady
from tidal.engine.output import RequestDelta
from tidal.serving.ray_router import TidalRequestRouter

APP_NAME = "tidal"
# Scale up while the replicas' mean KV usage is past this (their queues may still look short:
# long sequences fill the KV before they fill the batch).
KV_SCALE_UP = 0.9


@serve.deployment(name="TidalEngine")
class TidalEngine:
    """One engine replica: an EngineCore on a thread, behind `generate(AddRequest)`."""

    def __init__(self, config: EngineConfig) -> None:
        from tidal.client.in_thread import InThreadEngineClient
        from tidal.engine.builder import build_engine

        # The ingress deployment tokenizes; this replica only decodes.
        core = build_engine(config, decode_only=True)
        self.client = InThreadEngineClient(core)
        self.ready = EngineReady(
            pid=os.getpid(),
            incarnation=0,
            max_model_len=core.max_model_len,
            vocab_size=core.loaded.arch.vocab_size,
            num_blocks=core.num_blocks,
            load_time_s=core.loaded.load_time_s,
            device_type=core.loaded.device.type,
            device_memory_bytes=None,
        )

    def info(self) -> EngineReady:
        return self.ready

    async def generate(self, add: AddRequest) -> AsyncIterator[RequestDelta]:
        """The request's deltas as the engine makes them; its errors as raised (QueueFullError,
        ValueError, EngineError). A cancelled call aborts the request."""
        if not self.client.alive:
            self.client.start()  # on this replica's event loop, where the deltas are handed
        async for delta in self.client.generate(
            add.prompt_token_ids,
            add.params,
            add.request_id,
            prompt=add.prompt,
            priority=add.priority,
            session_id=add.session_id,
            timeout_s=add.timeout_s,
            queue_timeout_s=add.queue_timeout_s,
        ):
            yield delta

    def _load(self) -> dict[str, float]:
        stats = self.client.stats
        return {
            "num_requests": float(self.client.num_in_flight),
            "kv_usage": stats.kv_usage if stats is not None else 0.0,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        return self._load()  # read by TidalRequestRouter

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self._load()  # read by scale_on_queue_and_kv

    def pid(self) -> int:
        return os.getpid()


@serve.deployment(name="TidalServer", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class TidalServer:
    """The ingress: `tidal serve`'s own FastAPI app, its engine client the engine deployment."""

    def __init__(self, engine: Any, config: TidalConfig, model_path: str) -> None:
        self.engine = engine  # DeploymentHandle of TidalEngine
        self.config = config
        self.model_path = model_path

    async def __serve_build_asgi_app__(self):  # -> FastAPI
        from tidal.client.supervised import load_api_tokenizer
        from tidal.loader.chat_template import read_chat_template
        from tidal.server.app import build_app
        from tidal.server.inputs import PromptLimits
        from tidal.server.metrics import ServerMetrics
        from tidal.server.state import ServerState, model_settings
        from tidal.serving.ray_client import RayEngineClient

        cfg = self.config
        info: EngineReady = await self.engine.info.remote()
        client = RayEngineClient(self.engine)
        client.tokenizer = load_api_tokenizer(self.model_path)
        if cfg.server.chat_template is not None:
            client.tokenizer.chat_template = read_chat_template(cfg.server.chat_template)
        sched = cfg.engine.scheduler
        state = ServerState(
            engine=client,
            config=cfg,
            metrics=ServerMetrics(
                target_ttft_ms=sched.target_ttft_ms, target_tpot_ms=sched.target_tpot_ms
            ),
            served_name=cfg.engine.model.served_name(Path(self.model_path).stem),
            model_root=self.model_path,
            limits=PromptLimits.of(cfg.engine.limits, info.max_model_len, info.vocab_size),
            **model_settings(cfg, client.tokenizer, self.model_path),
        )
        return build_app(state)


def scale_on_queue_and_kv(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve autoscaling policy: enough replicas for the queue (ongoing requests over
    target_ongoing_requests per replica), one more while the mean KV usage is past KV_SCALE_UP;
    within the capacity-adjusted bounds. `ctx` is ray.serve.config.AutoscalingContext."""
    target = ctx.config.target_ongoing_requests if ctx.config is not None else None
    by_queue = math.ceil(ctx.total_num_requests / target) if target else ctx.current_num_replicas
    kv = (ctx.aggregated_metrics or {}).get("kv_usage") or {}
    full = bool(kv) and sum(kv.values()) / len(kv) > KV_SCALE_UP
    wanted = max(by_queue, ctx.current_num_replicas + 1 if full else 0)
    lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    return min(max(wanted, lo), hi), ctx.policy_state


def build(
    config: TidalConfig, num_replicas: int | None = None, max_replicas: int | None = None
):  # -> ray.serve.Application
    """The bound application: `num_replicas` engines (hardware.data_parallel by default), or an
    autoscaled count between them and `max_replicas`."""
    from tidal.client.supervised import _model_path

    hw = config.engine.hardware
    num = num_replicas or hw.data_parallel
    if max_replicas is not None and max_replicas < num:
        raise ValueError(
            f"max_replicas={max_replicas} is invalid: expected at least the {num} replicas "
            "it starts with"
        )
    threads = hw.threads or 1
    engine_config = dataclasses.replace(
        config.engine, hardware=dataclasses.replace(hw, data_parallel=1, threads=threads)
    )
    sched = engine_config.scheduler
    options: dict[str, Any] = {
        "request_router_config": RequestRouterConfig(
            request_router_class=TidalRequestRouter,
            request_router_kwargs={"block_size": engine_config.cache.block_size},
        ),
        # The engine queues what it cannot batch yet (and refuses past max_queue itself).
        "max_ongoing_requests": sched.max_num_seqs + (sched.max_queue or sched.max_num_seqs),
        "ray_actor_options": {"num_cpus": threads},
    }
    if max_replicas is None:
        options["num_replicas"] = num
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=num,
            max_replicas=max_replicas,
            target_ongoing_requests=sched.max_num_seqs,
            policy=AutoscalingPolicy(policy_function=scale_on_queue_and_kv),
        )
    engine = TidalEngine.options(**options).bind(engine_config)
    return TidalServer.bind(engine, config, _model_path(config.engine))


def _config_from_env() -> TidalConfig:
    from tidal.config.loader import load_config

    return load_config(os.environ.get("TIDAL_CONFIG"), os.environ, {})


def __getattr__(name: str):  # noqa: ANN202
    # `serve run tidal.serving.ray:app` reads `app`: built on that first read (binding starts
    # nothing), so importing this module for `build` resolves no model.
    if name == "app":
        return build(_config_from_env())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serve_forever(config: TidalConfig, max_replicas: int | None = None) -> int:
    """`tidal serve --ray`: start (or join, with RAY_ADDRESS) a Ray cluster, run the app on
    server.host:server.port until SIGINT/SIGTERM, then shut Serve down. Exit code."""
    import signal
    import sys
    import threading

    import ray

    server = config.server
    if server.port == 0:
        raise ValueError(
            "server.port=0 is invalid with --ray: Ray Serve's HTTP proxy listens on a fixed port"
        )
    application = build(config, max_replicas=max_replicas)  # a bad setting fails before Ray
    ray.init(address=os.environ.get("RAY_ADDRESS"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        sys.stdout.write(
            f"tidal: serving on Ray Serve, listening on http://{server.host}:{server.port}\n"
        )
        sys.stdout.flush()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
