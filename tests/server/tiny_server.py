"""A tiny random Gemma 3 checkpoint with a char-level tokenizer, and a `tidal serve` subprocess on it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
CHARS = string.ascii_letters + string.digits + " .,;:!?'\"-()\n"
VOCAB_SIZE = 128  # tests/models/tiny_hf.py's vocabulary size
# Whole words fill the rest of the vocabulary so every id the random model samples has text; the
# char-level pre-tokenizer never produces them, so encoding stays one token per character.
WORDS = [f" w{i}" for i in range(VOCAB_SIZE - len(SPECIALS) - len(CHARS))]


def write_char_tokenizer(out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json: one token per character, Gemma's special tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS) + WORDS)}
    assert len(vocab) == VOCAB_SIZE
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters with nothing between them
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_checkpoint(out_dir: Path) -> Path:
    """A random tiny Gemma 3 (tests/models/tiny_hf.py) plus a char-level tokenizer, in `out_dir`."""
    from tests.models.tiny_hf import make_tiny_model

    out_dir.mkdir(parents=True, exist_ok=True)
    make_tiny_model("gemma3", out_dir, seed=0)
    write_char_tokenizer(out_dir)
    return out_dir


_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


class ServerProcess:
    """`python -m tidal.cli_serve` on 127.0.0.1 with a free port; the port is read from its log."""

    def __init__(self, args: list[str], startup_timeout_s: float = 120.0) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "tidal.cli_serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        found = threading.Event()
        self.base_url = ""

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
            raise RuntimeError("tidal serve did not start:\n" + "".join(self.lines))

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        import httpx2 as httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.base_url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("tidal serve never became ready:\n" + "".join(self.lines))

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def engine_pid(self, incarnation: int = 0) -> int:
        """The pid of the supervised engine process `incarnation` (0 is the first), from the log."""
        m = re.search(rf"engine process (\d+) ready \(incarnation {incarnation},", self.log)
        if m is None:
            raise AssertionError(f"no engine incarnation {incarnation} in the log:\n{self.log}")
        return int(m.group(1))

    @contextlib.contextmanager
    def engine_paused(self, incarnation: int = 0) -> Iterator[None]:
        """SIGSTOP the engine process for the block, SIGCONT after: while paused no request can make
        progress, so a test can hold one open by construction instead of racing the machine's
        speed. Keep the block short next to server.watchdog_timeout_s (30 s by default)."""
        pid = self.engine_pid(incarnation)
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def wait_until(self, check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
        """Poll check() every 20 ms; fail with the server's log tail when it never holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.02)
        raise AssertionError(f"{what} never happened:\n{self.log[-4000:]}")


def serve(args: list[str]) -> Iterator[ServerProcess]:
    """Fixture body: start, wait until ready, yield, always tear down."""
    server = ServerProcess(args)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
