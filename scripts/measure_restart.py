"""Measure kill-to-ready: SIGKILL the engine process of a real `tidal serve` and time /ready.

Each run starts a fresh `tidal serve` on 127.0.0.1 (the bundled model unless --model is given),
waits until /ready is 200, sends one greedy completion, then --kills times: waits (up to
--settle-s) until a standby engine process reports ready where one is expected, SIGKILLs the
engine process and polls /ready every 10 ms: the time it turns 503 and the time it is 200 again.
The same greedy completion is then sent again and must return the same text. The engine's own
phase line for the new incarnation (spawn, import, build, warmup) and the loader's line are
printed as the breakdown, with the load average at the kill.

By default (server.standby null) the first kill restarts cold and later ones from the standby
spawned after it; `-- --standby` has one from the start, `-- --no-standby` never.

    python scripts/measure_restart.py --runs 3
    python scripts/measure_restart.py --runs 1 -- --kv-cache-bytes 268435456

The last line is one JSON record with every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
_POLL_S = 0.01
_PROMPT = "The tide comes in and"


@dataclass(slots=True)
class RunResult:
    from_standby: bool
    kill_to_503_s: float
    kill_to_ready_s: float
    load_avg_at_kill: tuple[float, float, float]
    same_greedy_text: bool
    engine_phases: str  # the engine's "engine phases" line for the restarted incarnation
    loader_line: str  # the loader's "model loaded" line for the restarted incarnation
    extra: dict[str, str] = field(default_factory=dict)


class _Server:
    """`python -m tidal.cli_serve` with its combined output collected line by line."""

    def __init__(self, args: list[str], startup_timeout_s: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "tidal.cli_serve", "--host", "127.0.0.1", "--port", "0"]
        self.proc = subprocess.Popen(
            [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self.base_url = ""
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = _LISTENING.search(line)
                if m and not found.is_set():
                    self.base_url = f"http://{m.group(1)}:{m.group(2)}"
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(startup_timeout_s) or not self.base_url:
            self.stop()
            raise RuntimeError("tidal serve did not start:\n" + self.log)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def ready_status(self) -> int:
        try:
            with urllib.request.urlopen(self.base_url + "/ready", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def complete(self, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            self.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def find(self, pattern: str, timeout_s: float = 0.0) -> re.Match[str] | None:
        deadline = time.monotonic() + timeout_s
        while True:
            m = re.search(pattern, self.log)
            if m is not None or time.monotonic() >= deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _wait_status(server: _Server, want: int, timeout_s: float) -> float:
    """Poll /ready until it answers `want`; the monotonic time it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.ready_status() == want:
            return time.monotonic()
        if server.proc.poll() is not None:
            break
        time.sleep(_POLL_S)
    raise RuntimeError(f"/ready never answered {want}:\n{server.log}")


def _standby_expected(serve_args: list[str], kill: int) -> bool:
    if "--no-standby" in serve_args:
        return False
    return "--standby" in serve_args or kill > 0  # the default: one after the first restart


def measure_once(
    serve_args: list[str], settle_s: float, timeout_s: float, kills: int
) -> list[RunResult]:
    server = _Server(serve_args, timeout_s)
    results = []
    try:
        _wait_status(server, 200, timeout_s)
        before = server.complete(_PROMPT)
        for kill in range(kills):
            m = server.find(rf"engine process (\d+) ready \(incarnation {kill},", 5.0)
            if m is None:
                raise RuntimeError(
                    "no engine pid in the log (is the engine process on?):\n" + server.log
                )
            pid = int(m.group(1))
            from_standby = False
            if _standby_expected(serve_args, kill):
                # A real kill comes long after the start: let the standby finish importing first.
                # One standby per kill so far, plus the first one when it came at the start.
                wanted = kill + 1 if "--standby" in serve_args else kill
                ready = r"standby engine process \d+ ready"
                deadline = time.monotonic() + settle_s
                while len(re.findall(ready, server.log)) < wanted and time.monotonic() < deadline:
                    time.sleep(0.05)
                from_standby = True
            load_avg = os.getloadavg()
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            down_at = _wait_status(server, 503, timeout_s)
            up_at = _wait_status(server, 200, timeout_s)
            after = server.complete(_PROMPT)
            phases = server.find(rf"engine phases \(incarnation {kill + 1}[^)]*\): ([^\n]*)", 5.0)
            loads = re.findall(r"\[engine\]: (model loaded [^\n]*)", server.log)
            results.append(
                RunResult(
                    from_standby=from_standby,
                    kill_to_503_s=down_at - killed_at,
                    kill_to_ready_s=up_at - killed_at,
                    load_avg_at_kill=load_avg,
                    same_greedy_text=before == after,
                    engine_phases="" if phases is None else phases.group(1),
                    loader_line=loads[-1] if loads else "",
                    extra={"text": after},
                )
            )
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh servers")
    parser.add_argument("--kills", type=int, default=2, help="engine kills per server, in turn")
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=60.0,
        help="longest wait after ready for a standby engine to be ready before the kill",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on every wait")
    parser.add_argument("serve_args", nargs="*", help="extra `tidal serve` arguments after --")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.kills < 1:
        raise ValueError(f"--runs={args.runs}, --kills={args.kills}: expected integers >= 1")
    serve_args = list(args.serve_args)
    if args.model is not None:
        serve_args = ["--model", args.model, *serve_args]
    results = []
    for i in range(args.runs):
        for k, r in enumerate(measure_once(serve_args, args.settle_s, args.timeout_s, args.kills)):
            results.append(r)
            la = ", ".join(f"{x:.2f}" for x in r.load_avg_at_kill)
            how = "from the standby" if r.from_standby else "cold"
            print(
                f"run {i + 1} kill {k + 1} ({how}): kill->503 {r.kill_to_503_s:.2f} s, "
                f"kill->ready {r.kill_to_ready_s:.2f} s, same greedy text: "
                f"{r.same_greedy_text}, load average {la}",
                flush=True,
            )
            print(f"  engine: {r.engine_phases}", flush=True)
            print(f"  loader: {r.loader_line}", flush=True)
    for how in (False, True):
        ready = sorted(r.kill_to_ready_s for r in results if r.from_standby is how)
        if ready:
            print(
                f"kill->ready {'from the standby' if how else 'cold'}: min {ready[0]:.2f} s, "
                f"median {ready[len(ready) // 2]:.2f} s, max {ready[-1]:.2f} s"
            )
    print(json.dumps({"runs": [asdict(r) for r in results]}))
    return 0 if all(r.same_greedy_text for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
