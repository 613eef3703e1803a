"""`tidal serve`: load the config (YAML < env < CLI), build the engine, warm up, serve the OpenAI API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from pathlib import Path

from tidal.config.engine import TidalConfig
from tidal.config.loader import (
    add_cli_arguments,
    cli_flags_from_args,
    cli_overrides_from_args,
    dump_config,
    load_config,
)

log = logging.getLogger("tidal.serve")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the `tidal` command's subparsers."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /metrics, /health, /ready).",
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it: the same as --model",
    )
    add_cli_arguments(parser)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration as YAML (API keys masked) and exit",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve (the ray extra): hardware.data_parallel engine replicas as a "
        "deployment behind tidal's router, on a local cluster or the one RAY_ADDRESS names",
    )
    parser.add_argument(
        "--ray-max-replicas",
        type=int,
        default=None,
        metavar="M",
        help="with --ray: autoscale the engine replicas between hardware.data_parallel and M "
        "on queue length and KV usage",
    )


def run(args: argparse.Namespace) -> int:
    """Load the config; print it with --print-config, else serve until SIGINT/SIGTERM. Exit code."""
    try:
        flags = cli_overrides_from_args(args)
    except ValueError as e:
        print(f"tidal serve: {e}", file=sys.stderr)
        return 2
    positional = getattr(args, "model_path", None)
    if positional is not None:
        if flags.get("model.path", positional) != positional:
            print(f"tidal serve: the model is {positional!r} and --model {flags['model.path']!r}: "
                  "give one", file=sys.stderr)  # fmt: skip
            return 2
        flags["model.path"] = positional
    try:
        cfg = load_config(args.config, os.environ, flags, cli_flags_from_args(args))
    except (ValueError, OSError) as e:
        print(f"tidal serve: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_config(cfg))
        return 0
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    max_replicas = getattr(args, "ray_max_replicas", None)
    if max_replicas is not None and not getattr(args, "ray", False):
        print("tidal serve: --ray-max-replicas needs --ray", file=sys.stderr)
        return 2
    try:
        if getattr(args, "ray", False):
            return _serve_on_ray(cfg, max_replicas)
        return serve(cfg)
    except ValueError as e:  # a config that only the loaded model can find wrong
        print(f"tidal serve: {e}", file=sys.stderr)
        return 2


def serve(cfg: TidalConfig) -> int:
    import uvicorn

    from tidal.engine.errors import EngineError
    from tidal.server.app import build_app
    from tidal.server.inputs import PromptLimits
    from tidal.server.metrics import ServerMetrics
    from tidal.server.state import ServerState, model_settings

    template = None
    if cfg.server.chat_template is not None:  # a bad template fails before the model loads
        from tidal.loader.chat_template import read_chat_template

        try:
            template = read_chat_template(cfg.server.chat_template)
        except ValueError as e:
            print(f"tidal serve: server.chat_template: {e}", file=sys.stderr)
            return 2
    # Bind first: a taken port fails before minutes of model loading, and port 0 is resolved.
    sock = _bind(cfg.server.host, cfg.server.port)
    sched = cfg.engine.scheduler
    metrics = ServerMetrics(
        target_ttft_ms=sched.target_ttft_ms,
        target_tpot_ms=sched.target_tpot_ms,
        num_replicas=cfg.engine.hardware.data_parallel,
    )
    if cfg.server.engine_process:
        try:
            engine, model_root, max_model_len, vocab_size = _supervised_engine(cfg, metrics)
        except EngineError as e:
            print(f"tidal serve: the engine failed to start: {e}", file=sys.stderr)
            return 1
    else:
        engine, model_root, max_model_len, vocab_size = _in_thread_engine(cfg, metrics)
    if template is not None:
        engine.tokenizer.chat_template = template
    try:
        per_model = model_settings(cfg, engine.tokenizer, model_root)
    except ValueError as e:
        print(f"tidal serve: {e}", file=sys.stderr)
        asyncio.run(engine.shutdown())
        return 2
    state = ServerState(
        engine=engine,
        config=cfg,
        metrics=metrics,
        served_name=cfg.engine.model.served_name(Path(model_root).stem),
        model_root=model_root,
        limits=PromptLimits.of(cfg.engine.limits, max_model_len, vocab_size),
        **per_model,
    )
    app = build_app(state)
    uv_config = uvicorn.Config(
        app,
        loop="auto",  # uvloop when installed
        http="auto",  # httptools when installed
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=max(1, int(cfg.server.drain_timeout_s)),
    )
    server = _make_server_class()(uv_config, state)
    if cfg.server.engine_process:
        # The restart budget is spent: stop serving and exit non-zero so a process manager sees it.
        engine.on_fatal = lambda: setattr(server, "should_exit", True)
    host, port = sock.getsockname()[:2]
    # Tests and scripts read the port from this line (--port 0 picks a free one).
    # One write() for the whole line: print() writes the text and the newline separately, and the
    # engine process shares this stdout, so a log line could land between them (a wrapper reading
    # the address then saw "...:35041" run into the next line's date).
    sys.stdout.write(f"tidal: serving {state.served_name!r} listening on http://{host}:{port}\n")
    sys.stdout.flush()
    server.run(sockets=[sock])
    fatal = engine.fatal
    if fatal:
        print(f"tidal serve: {fatal}", file=sys.stderr)
        return 1
    return 0


def _serve_on_ray(cfg: TidalConfig, max_replicas: int | None) -> int:
    try:
        from tidal.serving.ray import serve_forever
    except ImportError as e:  # the ray extra is not installed
        print(f"tidal serve: {e}", file=sys.stderr)
        return 2
    return serve_forever(cfg, max_replicas)


def _in_thread_engine(cfg: TidalConfig, metrics):  # -> (EngineClient, model root, len, vocab)
    """Load the model into this process (server.engine_process: false) behind the same client."""
    from tidal.client.in_thread import InThreadEngineClient
    from tidal.engine.builder import build_engine

    if cfg.engine.hardware.tensor_parallel > 1:
        # NOTE: a lost rank ends the engine; only a supervised engine process is restarted.
        raise ValueError(
            f"hardware.tensor_parallel={cfg.engine.hardware.tensor_parallel} is invalid with "
            "server.engine_process false: tensor-parallel ranks run under the supervised engine "
            "process; set server.engine_process true"
        )
    core = build_engine(cfg.engine, progress=log.info)
    metrics.replica(0).model_load.set(core.loaded.load_time_s)
    if core.loaded.device.type == "cuda":
        import torch

        metrics._device_memory_bytes = torch.cuda.get_device_properties(
            core.loaded.device
        ).total_memory
    engine = InThreadEngineClient(core)
    metrics.replica(0).hook(engine)
    return engine, str(core.loaded.path), core.max_model_len, core.loaded.arch.vocab_size


def _supervised_engine(cfg: TidalConfig, metrics):  # -> (EngineClient, model root, len, vocab)
    """Start the engine process (blocking until it is loaded) with the metrics hooked to it; with
    hardware.data_parallel N, N of them behind the router, each with its own supervisor."""
    from tidal.client.supervised import SupervisedEngineClient
    from tidal.supervisor.restart_policy import RestartPolicy

    server = cfg.server
    num_replicas = cfg.engine.hardware.data_parallel
    configs = [cfg.engine]
    if num_replicas > 1:
        from tidal.router.replica_config import available_cores, replica_engine_config

        configs = [replica_engine_config(cfg.engine, num_replicas, available_cores())]
        configs *= num_replicas
        log.info(
            "data parallel: %d engine replicas, %d CPU threads each",
            num_replicas,
            configs[0].hardware.threads,
        )
    clients = [
        SupervisedEngineClient(
            config,
            policy=RestartPolicy(
                max_restarts=server.engine_max_restarts, window_s=server.engine_restart_window_s
            ),
            watchdog_timeout_s=server.watchdog_timeout_s,
            warmup_on_restart=server.warmup,
            log_level=logging.getLogger().getEffectiveLevel(),
            # A standby process per replica would double the processes; while one replica
            # restarts cold, the others serve.
            standby=server.standby if num_replicas == 1 else False,
        )
        for config in configs
    ]
    for i, client in enumerate(clients):
        metrics.replica(i).hook(client)
    engine = clients[0]
    if num_replicas > 1:
        from tidal.router.replicated import ReplicatedEngineClient

        engine = ReplicatedEngineClient(clients, cfg.engine.cache.block_size)
        engine.on_route = lambda i, reason: metrics.replica(i).routed(reason)
    info = engine.launch()  # ValueError: a bad setting (exit 2); EngineError: a crash (exit 1)
    for i, client in enumerate(clients):
        metrics.replica(i).model_load.set(client.info.load_time_s)
    metrics._device_memory_bytes = info.device_memory_bytes
    return engine, str(Path(clients[0].model_path)), info.max_model_len, info.vocab_size


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"server.port={port} is invalid: cannot listen on {host}:{port} ({e})"
        ) from None
    sock.set_inheritable(True)
    return sock


def _make_server_class():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, marking the app as draining (/ready 503) as soon as a signal arrives."""

        def __init__(self, config: uvicorn.Config, state) -> None:
            super().__init__(config)
            self.tidal_state = state

        def handle_exit(self, sig, frame) -> None:  # type: ignore[no-untyped-def]
            self.tidal_state.draining = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after shutting down, which would end the process
            # with -SIGTERM; a drained shutdown is a clean exit (0) for systemd and Kubernetes.
            self._captured_signals.clear()

    return _Server


def main(argv: list[str] | None = None) -> int:
    """`python -m tidal.cli_serve ...`: the serve command without the `tidal` front end."""
    parser = argparse.ArgumentParser(prog="tidal serve")
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
