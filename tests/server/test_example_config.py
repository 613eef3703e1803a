"""examples/tidal.yaml loads through `tidal serve --print-config` and every value in it takes effect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tidal.config.keys import parse_bytes
from tidal.config.loader import config_sections, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tidal.yaml"


def _clean_env() -> dict[str, str]:
    """The environment without TIDAL_<SECTION>_* config variables, so only the file counts."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}


def test_every_value_in_the_example_takes_effect() -> None:
    written = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    effective = config_sections(load_config(str(EXAMPLE), {}, {}))
    assert set(written) == set(effective)
    for section, body in written.items():
        for key, value in body.items():
            if key.endswith("_bytes") and isinstance(value, str):
                value = parse_bytes(value)
            assert effective[section][key] == value, f"{section}.{key}"
    assert effective["memory"]["kv_cache_bytes"] == 1 << 30
    assert effective["server"]["max_body_bytes"] == 4 << 20


def test_print_config_of_the_example() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli_serve", "--config", str(EXAMPLE), "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed == config_sections(load_config(str(EXAMPLE), {}, {}))


def test_env_and_flags_override_the_example() -> None:
    env = {"TIDAL_SERVER_PORT": "9000", "TIDAL_BATCHING_MAX_NUM_SEQS": "8"}
    cfg = load_config(str(EXAMPLE), env, {"server.port": 9001})
    assert cfg.server.port == 9001  # flag beats environment
    assert cfg.engine.scheduler.max_num_seqs == 8  # environment beats file (32)
    assert cfg.engine.scheduler.max_queue == 256  # the file beats the default (1024)
