"""Fixtures shared by the whole test suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.loader.bundled import bundled_model_path


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    """Path of the bundled Gemma 3 270M Q4_K_M GGUF (assembled once per machine, then reused)."""
    return bundled_model_path()
