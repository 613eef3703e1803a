"""`tidal serve --ray` refuses what it cannot honour before starting anything, and a missing ray
extra is a clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _serve(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "tidal.cli_serve"]
    return subprocess.run(
        [*argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_ray_needs_a_fixed_port() -> None:
    pytest.importorskip("ray.serve")
    r = _serve("--ray", "--port", "0")
    assert r.returncode == 2
    assert "server.port=0 is invalid with --ray" in r.stderr


def test_max_replicas_needs_ray_and_at_least_the_starting_count() -> None:
    r = _serve("--ray-max-replicas", "2")
    assert r.returncode == 2 and "--ray-max-replicas needs --ray" in r.stderr
    pytest.importorskip("ray.serve")
    r = _serve("--ray", "--port", "8123", "--data-parallel", "3", "--ray-max-replicas", "2")
    assert r.returncode == 2 and "max_replicas=2 is invalid" in r.stderr


def test_without_the_ray_extra_the_error_names_it() -> None:
    # ray made unimportable in a fresh interpreter, as on an install without the extra.
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from tidal.cli_serve import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    r = _serve("--ray", "--port", "8123", code=code)
    assert r.returncode == 2
    assert "pip install 'tidal[ray]'" in r.stderr
