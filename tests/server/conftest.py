"""Session fixtures for server tests: one tiny checkpoint and the `tidal serve` processes on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.tiny_server import ServerProcess, make_tiny_checkpoint, serve

API_KEY = "sk-tidal-test"
MAX_INPUT_TOKENS = 100
MAX_BODY_BYTES = 65536
# A few MiB of KV is thousands of tokens for the tiny model; the default would size it from RAM.
KV_BYTES = str(4 << 20)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_server_ckpt"))


@pytest.fixture(scope="session")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    """The main server: auth on, small body and prompt limits."""
    yield from serve(
        [
            "--model", str(tiny_checkpoint),
            "--kv-cache-bytes", KV_BYTES,
            "--api-key", API_KEY,
            "--max-input-tokens", str(MAX_INPUT_TOKENS),
            "--max-body-bytes", str(MAX_BODY_BYTES),
            "--served-model-name", "tiny",
        ]
    )  # fmt: skip


@pytest.fixture(scope="session")
def narrow_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    """One sequence at a time and one waiting seat: the third concurrent request gets 429."""
    yield from serve(
        [
            "--model", str(tiny_checkpoint),
            "--kv-cache-bytes", KV_BYTES,
            "--max-num-seqs", "1",
            "--max-queue", "1",
            "--no-warmup",
        ]
    )  # fmt: skip
