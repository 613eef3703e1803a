"""Compare: start each target server (tidal, its ablations, baselines) in turn and replay one trace on each."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tidal.bench.baselines import BASELINES, Baseline
from tidal.bench.llama_bench import describe_exit
from tidal.bench.run import RunConfig, resolve_model, run_sweep
from tidal.bench.run_stats import SLO, RunStats
from tidal.bench.stream_client import RequestOptions, RequestRecord

DEFAULT_NUM_REQUESTS = 8  # 4 chat sessions x 2 turns: server start-up dominates on 2 busy cores
DEFAULT_CONCURRENCY = 4
TPOT_TARGET = "tidal-target-tpot"  # made from --target-tpot-ms; not in TARGETS
# The address ends the line (servers write it in one write()); anything else is not trusted.
_LISTENING = re.compile(r"listening on (http://(?:[\w.\-]+|\[[0-9a-fA-F:]+\]):\d{1,5})\s*$")


@dataclass(frozen=True, slots=True)
class Target:
    """One server to benchmark: `kind` says how to start it; `args` are added to its command."""

    name: str
    kind: str  # "tidal" | "hf-static" | a baseline's name ("llama.cpp", "ik_llama.cpp")
    args: tuple[str, ...] = ()
    about: str = ""


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "tidal",
            "tidal",
            (),
            "tidal serve defaults (a GGUF's own blocks, int8 activations, on CPU)",
        ),
        Target(
            "tidal-gguf",
            "tidal",
            ("--quantization", "gguf"),
            "tidal serve --quantization gguf (the file's blocks, float32 activations)",
        ),  # fmt: skip
        # The gate's verdict is cached beside the model after the first start; a benchmark
        # measures speed, so it does not wait for the gate either way.
        Target(
            "tidal-int8",
            "tidal",
            ("--quantization", "int8", "--no-quantization-gate"),
            "tidal serve --quantization int8 (weights in int8 groups of 32)",
        ),  # fmt: skip
        Target("tidal-no-prefix-cache", "tidal", ("--no-prefix-caching",), "ablation"),
        Target(
            "tidal-standby",
            "tidal",
            ("--standby",),
            "restarts: a spare engine process from the start (~0.24 GB more RSS, ~1.1 s restarts)",
        ),  # fmt: skip
        Target(
            "tidal-kv-f32",
            "tidal",
            ("--kv-cache-dtype", "float32"),
            "memory: float32 KV pages (twice the default float16's bytes over a GGUF's blocks)",
        ),  # fmt: skip
        Target(
            "tidal-cpu-budget-300",
            "tidal",
            ("--cpu-budget-step-ms", "300"),
            "latency: steps of ~300 ms from the cost model while anything decodes (CPU)",
        ),  # fmt: skip
        Target(
            "tidal-no-spec",
            "tidal",
            ("--num-speculative-tokens", "0"),
            "ablation: no prompt-lookup drafts (the default checks up to 4 a step)",
        ),  # fmt: skip
        Target("tidal-no-chunked-prefill", "tidal", ("--no-chunked-prefill",), "ablation"),
        Target("tidal-max-num-seqs-1", "tidal", ("--max-num-seqs", "1"), "ablation: no batching"),
        Target(
            "tidal-dp2",
            "tidal",
            ("--data-parallel", "2"),
            "tidal serve --data-parallel 2 (two engine replicas behind the router; --threads "
            "is per replica)",
        ),  # fmt: skip
        Target("llama.cpp", "llama.cpp", (), "llama-server, continuous batching, --parallel N"),
        Target(
            "ik_llama.cpp",
            "ik_llama.cpp",
            (),
            "ik_llama.cpp's llama-server as llama.cpp's, with -rtr (weights repacked at load, so "
            "no mmap: its RSS holds the model); -fa and -mla 3 are its defaults",
        ),  # fmt: skip
        # NOTE: ik_llama.cpp 8337e4c's flash attention aborts now and then on Gemma 3's sliding-
        # window layers ("found empty attention mask", SIGABRT): this target runs without it.
        Target(
            "ik_llama.cpp-no-fa",
            "ik_llama.cpp",
            ("-fa", "off"),
            "ik_llama.cpp as above without flash attention (slower; its FA can abort on "
            "sliding-window models)",
        ),  # fmt: skip
        Target("hf-static", "hf-static", (), "BASELINE: transformers, static batches"),
    )
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled Gemma 3 270M)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, from {list(TARGETS)}")  # fmt: skip
    p.add_argument("--target-tpot-ms", type=float, default=None,
                   help=f"also run tidal with this TPOT target, as target {TPOT_TARGET!r} after 'tidal'")  # fmt: skip
    p.add_argument("--parallel", type=int, default=DEFAULT_CONCURRENCY,
                   help="llama-server --parallel slots, tidal's --max-num-seqs (both servers run "
                        "as many sequences at once) and the HF baseline's batch size")  # fmt: skip
    # One thread by default: on a shared 2-core box, 2 torch threads per server spin against the
    # other processes and a step took seconds; every target gets the same count either way.
    p.add_argument("--threads", type=int, default=1, help="CPU threads per server (all targets)")
    p.add_argument("--context-tokens", type=int, default=None,
                   help="KV tokens every server holds: llama-server's -c and tidal's "
                        "--kv-cache-tokens, so memory is compared at equal tokens "
                        "(default: 4096 per --parallel slot)")  # fmt: skip
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="server logs (default: next to --json, else a temp dir)")  # fmt: skip


class ServerHandle:
    """A started target: its process, base URL and log file; `stop()` always ends it."""

    def __init__(
        self,
        cmd: list[str],
        log_path: Path,
        base_url: str | None = None,
        baseline: Baseline | None = None,
    ) -> None:
        self.cmd = cmd
        self.baseline = baseline  # a baseline's exit statuses are explained as its own
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        # NOTE: a baseline runs in its log's directory: ik_llama.cpp's server writes a llama.log
        # of its own into its working directory (its paths are absolute, start_target).
        self.proc = subprocess.Popen(
            # a server may log bytes that are not UTF-8 (ik_llama.cpp's half tokens): replaced,
            # never the end of the pump (and of the log) with a UnicodeDecodeError
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            cwd=log_path.parent if baseline is not None else None,
        )  # fmt: skip
        self.base_url = base_url
        self._found = threading.Event()
        if base_url:
            self._found.set()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            m = _LISTENING.search(line)
            if m and not self._found.is_set():
                self.base_url = m.group(1)
                self._found.set()
        self._found.set()

    def wait_ready(self, ready_path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if not self._found.wait(timeout_s) or not self.base_url:
            raise RuntimeError(f"server printed no address; see {self.log_path}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server {describe_exit(self.proc.returncode, self.baseline)}; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.base_url + ready_path, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # refused while loading, or 503 until warm
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tidal_command(t: Target, model: Path | None, args: argparse.Namespace) -> list[str]:
    """`tidal serve` for a tidal target, configured as llama-server is: its KV pool holds
    llama-server's context over as many sequences as llama-server has slots, unless the target
    sets these itself. (tidal sizes the pool for every sequence's sliding windows, so 32
    sequences' windows over llama-server's one slot's would hold more KV than llama-server.)"""
    cmd = [sys.executable, "-m", "tidal.cli_serve", "--host", "127.0.0.1", "--port", "0",
           "--threads", str(args.threads)]  # fmt: skip
    if not any(a.startswith("--kv-cache") for a in t.args):
        cmd += ["--kv-cache-tokens", str(context_tokens(args))]
    if "--max-num-seqs" not in t.args:
        cmd += ["--max-num-seqs", str(args.parallel)]
    if model is not None:
        cmd += ["--model", str(model)]
    return cmd + list(t.args)


def start_target(
    t: Target, model: Path | None, args: argparse.Namespace, log_dir: Path
) -> tuple[ServerHandle, str]:
    """(handle, ready path). Raises FileNotFoundError when llama-server is not built."""
    log = log_dir / f"{t.name}.log"
    common = ["--host", "127.0.0.1", "--port", "0"]
    if t.kind == "tidal":
        return ServerHandle(tidal_command(t, model, args), log), "/ready"
    gguf = model if model is not None else _bundled_gguf()
    if t.kind == "hf-static":
        cmd = [sys.executable, "-m", "tidal.bench.hf_static_server", *common, "--model", str(gguf),
               "--batch-size", str(args.parallel), "--threads", str(args.threads)]  # fmt: skip
        return ServerHandle(cmd + list(t.args), log), "/ready"
    if t.kind in BASELINES:
        baseline = BASELINES[t.kind]
        binary = baseline.find_server()
        if binary is None:
            raise FileNotFoundError(
                f"{baseline.server_path()} is not built: run {baseline.build_script}"
            )
        port = _free_port()  # llama-server cannot pick one and tell us; a tiny race, accepted
        cmd = llama_server_command(os.path.abspath(binary), baseline, gguf.absolute(), port, args)
        cmd += list(t.args)
        return ServerHandle(cmd, log, f"http://127.0.0.1:{port}", baseline), "/health"
    raise ValueError(
        f"target kind={t.kind!r} is invalid: expected tidal, hf-static or one of {list(BASELINES)}"
    )


def llama_server_command(
    binary: str, baseline: Baseline, gguf: Path, port: int, args: argparse.Namespace
) -> list[str]:
    """llama-server of a baseline, configured as every baseline's is (slots, context, threads),
    with the baseline's own flags for speed on a CPU after."""
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(args.parallel), "--cont-batching", "--metrics",
           "-c", str(context_tokens(args)), "-t", str(args.threads)]  # fmt: skip
    return cmd + list(baseline.server_args)


def context_tokens(args: argparse.Namespace) -> int:
    """The KV tokens each server is given: llama-server's -c, tidal's --kv-cache-tokens. Both
    keep sliding-window layers' pages at what the windows of their sequences can see (llama.cpp
    without --swa-full; tidal's num_blocks_for_tokens)."""
    return args.context_tokens or 4096 * args.parallel


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _bundled_gguf() -> Path:
    from tidal.loader.bundled import bundled_model_path

    return bundled_model_path()


def run(args: argparse.Namespace) -> int:
    """`tidal bench compare`: every target in turn on the same trace and loads; one table."""
    import asyncio

    from tidal.bench.cli import loads_from_args, traces_from_args, vars_of, write_outputs

    names, targets = target_list(args.targets, args.target_tpot_ms)
    loads = loads_from_args(args)
    traces = traces_from_args(args, len(loads))
    model = Path(args.model) if args.model else None
    log_dir = Path(
        args.log_dir or (Path(args.json).parent if args.json else Path("/tmp")) / "compare_logs"
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RunStats] = []
    records: list[list[RequestRecord]] = []
    notes: dict[str, str] = {}
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so the `finally` below stops the server.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    for name in names:
        t = targets[name]
        started = time.monotonic()
        try:
            handle, ready = start_target(t, model, args, log_dir)
        except FileNotFoundError as e:
            notes[name] = f"skipped: {e}"
            print(f"{name}: {notes[name]}", file=sys.stderr)
            continue
        try:
            handle.wait_ready(ready, args.startup_timeout_s)
            load_s = time.monotonic() - started
            print(f"{name}: ready at {handle.base_url} after {load_s:.0f} s", file=sys.stderr)
            assert handle.base_url is not None
            served = asyncio.run(resolve_model(handle.base_url))
            cfg = RunConfig(
                base_url=handle.base_url,
                options=RequestOptions(served, args.temperature, args.ignore_eos),
                seed=args.seed,
                num_warmup=args.warmup,
                slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
                target=name,
                server_pid=handle.proc.pid,
                probe_interval_s=args.metrics_interval_s,
                progress=args.progress,
            )
            for stats, recs in run_sweep(cfg, traces, loads):
                runs.append(stats)
                records.append(recs)
            about = t.about
            if handle.baseline and (built := handle.baseline.built(Path(handle.cmd[0]).parent)):
                about += f"; built {built}"
            notes.setdefault(name, f"{about}; ready after {load_s:.0f} s")
            if (rc := handle.proc.poll()) is not None:  # it died during the runs
                notes[name] += (
                    f"; the server {describe_exit(rc, handle.baseline)} during the runs, see {handle.log_path}"
                )
        except (RuntimeError, OSError, ValueError) as e:  # ValueError: http.client.InvalidURL
            notes[name] = f"failed: {e}"
            print(f"{name}: {notes[name]}", file=sys.stderr)
        finally:
            handle.stop()
    meta = {"workload": vars_of(args), "targets": notes, "model": str(model or _bundled_gguf())}
    lines = [f"- {name}: {note}" for name, note in notes.items()]
    write_outputs(args, runs, records, meta, lines)
    return 0 if runs else 1


def target_list(text: str, target_tpot_ms: float | None) -> tuple[list[str], dict[str, Target]]:
    """The target names to run, in order, and their definitions; --target-tpot-ms adds
    TPOT_TARGET (tidal with the batch controller aiming at that TPOT) right after "tidal"."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    targets = dict(TARGETS)
    if target_tpot_ms is not None:
        if not (target_tpot_ms > 0):
            raise ValueError(
                f"--target-tpot-ms={target_tpot_ms} is invalid: expected a positive number"
            )
        ms = f"{target_tpot_ms:g}"
        about = f"tidal serve --target-tpot-ms {ms} (the latency-targeting batch controller)"
        targets[TPOT_TARGET] = Target(TPOT_TARGET, "tidal", ("--target-tpot-ms", ms), about)
        if TPOT_TARGET not in names:
            names.insert(names.index("tidal") + 1 if "tidal" in names else 0, TPOT_TARGET)
    unknown = [n for n in names if n not in targets]
    if unknown:
        hint = f" ({TPOT_TARGET} needs --target-tpot-ms)" if TPOT_TARGET in unknown else ""
        raise ValueError(f"targets={unknown} is invalid: expected names from {list(targets)}{hint}")
    return names, targets
