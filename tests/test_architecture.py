"""The layer order of docs/architecture.md holds for every import in tidal/, with no package cycles."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import tidal
from tests.import_graph import cycles, package_graph, read_layers, upward_imports

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(tidal.__path__, "tidal.")]
    assert len(names) > 100
    for name in names:
        importlib.import_module(name)


def test_imports_follow_the_layers() -> None:
    layers = read_layers(DOC)
    assert layers["config"] == 1 and layers["server"] == 8, layers
    graph = package_graph(ROOT, "tidal")
    problems = upward_imports(graph, layers)
    assert problems == [], "\n".join(problems)


def test_no_package_cycles() -> None:
    found = cycles(package_graph(ROOT, "tidal"))
    assert found == [], found


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def fake_tree(tmp_path: Path) -> Path:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "import os\n",
            "pkg/mid/__init__.py": "",
            "pkg/mid/b.py": "from pkg.low import a\n",
            "pkg/high.py": "from pkg.mid.b import x\n",
            "doc.md": "## Layers\n\n1. `low/`\n2. `mid/`\n3. `high`\n",
        },
    )
    return tmp_path


def test_the_check_passes_a_clean_tree(fake_tree: Path) -> None:
    graph = package_graph(fake_tree, "pkg")
    assert set(graph) == {("mid", "low"), ("high", "mid")}
    assert upward_imports(graph, read_layers(fake_tree / "doc.md")) == []
    assert cycles(graph) == []


def test_the_check_fails_on_an_upward_import(fake_tree: Path) -> None:
    # A lazy import inside a function counts as much as one at the top of the file.
    (fake_tree / "pkg/low/a.py").write_text("def f():\n    from pkg.mid import b\n")
    graph = package_graph(fake_tree, "pkg")
    problems = upward_imports(graph, read_layers(fake_tree / "doc.md"))
    assert problems == ["pkg.low.a:2 imports pkg.mid.b (low is layer 1, mid is layer 2)"]
    assert cycles(graph) == [["low", "mid"]]


def test_the_check_fails_on_a_relative_upward_import(fake_tree: Path) -> None:
    (fake_tree / "pkg/low/a.py").write_text("from ..mid.b import x\n")
    problems = upward_imports(package_graph(fake_tree, "pkg"), read_layers(fake_tree / "doc.md"))
    assert problems == ["pkg.low.a:1 imports pkg.mid.b.x (low is layer 1, mid is layer 2)"]


def test_the_check_fails_on_an_unlisted_package(fake_tree: Path) -> None:
    _write(fake_tree, {"pkg/extra/__init__.py": "from pkg.low import a\n"})
    problems = upward_imports(package_graph(fake_tree, "pkg"), read_layers(fake_tree / "doc.md"))
    assert problems == ["extra: not in the layer list"]


def test_the_api_process_runs_without_torch() -> None:
    """`tidal serve`'s API process parses the whole CLI and runs the server and the engine
    client; none of that may import torch (a quarter of a GB of resident memory in a process
    that never runs a model). A subprocess, so the test session's own imports do not count."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tidal.cli import build_parser\n"
        "build_parser().parse_args(['serve', '--port', '8000'])\n"
        "import tidal.cli_serve, tidal.server.app, tidal.client.supervised, tidal.router.replicated\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"the API process imported {out.stdout.strip()}"
