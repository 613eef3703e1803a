"""Fixtures for fault tests: one tiny checkpoint shared by every server these tests start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.tiny_server import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_fault_ckpt"))
