"""One tiny Gemma 3 directory (with a tokenizer) and its one-process outputs, shared by the
engine-level tensor-parallel tests (mp and ray backends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny import make_tiny_model_dir


@pytest.fixture(scope="session")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp-engine"), "gemma3")


@pytest.fixture(scope="session")
def reference(gemma: Path) -> list[tuple]:
    from tests.executor.test_tp_engine import _generate

    return _generate(gemma)
