"""Package-level import graph of a source tree, read with `ast`, checked against a layer order."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple


class Edge(NamedTuple):
    module: str  # importing module, dotted
    target: str  # imported module or name, dotted
    line: int


def module_name(root: Path, path: Path) -> str:
    """`root/pkg/a/b.py` -> `pkg.a.b`; `root/pkg/a/__init__.py` -> `pkg.a`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path) -> list[Edge]:
    """Every import in the file, lazy (inside functions) and TYPE_CHECKING ones included."""
    mod = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges += [Edge(mod, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # `from pkg import name`: name may be a submodule; the package unit is what counts
            edges += [Edge(mod, f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return edges


def unit_of(name: str, top: str, units: set[str]) -> str | None:
    """The layering unit of a dotted name: `top.pkg...` -> `pkg`; `top` or `top.attr` -> `top`."""
    parts = name.split(".")
    if parts[0] != top:
        return None
    if len(parts) > 1 and parts[1] in units:
        return parts[1]
    return top  # the package root itself (its public API), or a name it exports


def package_graph(root: Path, top: str) -> dict[tuple[str, str], list[Edge]]:
    """(importing unit, imported unit) -> the imports that make that edge, across units only."""
    units = {
        p.stem for p in (root / top).iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    units.discard("__init__")
    graph: dict[tuple[str, str], list[Edge]] = {}
    for path in sorted((root / top).rglob("*.py")):
        for edge in imports_of(root, path):
            src, dst = unit_of(edge.module, top, units), unit_of(edge.target, top, units)
            if src is None or dst is None or src == dst:
                continue
            graph.setdefault((src, dst), []).append(edge)
    return graph


def read_layers(doc: Path) -> dict[str, int]:
    """The numbered layer list of docs/architecture.md: every `name` on line `N. ...` is layer N."""
    layers: dict[str, int] = {}
    in_list = False
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            in_list = line.strip() == "## Layers"
            continue
        match = re.match(r"^(\d+)\.\s", line)
        if in_list and match:
            for name in re.findall(r"`([A-Za-z_][\w]*)/?`", line):
                layers[name] = int(match.group(1))
    return layers


def upward_imports(graph: dict[tuple[str, str], list[Edge]], layers: dict[str, int]) -> list[str]:
    """Imports from a lower layer up to a higher one, and units the layer list does not name."""
    problems: list[str] = []
    units = {u for edge in graph for u in edge}
    for unit in sorted(units - set(layers)):
        problems.append(f"{unit}: not in the layer list")
    for (src, dst), edges in sorted(graph.items()):
        if src in layers and dst in layers and layers[dst] > layers[src]:
            for e in edges:
                problems.append(
                    f"{e.module}:{e.line} imports {e.target} "
                    f"({src} is layer {layers[src]}, {dst} is layer {layers[dst]})"
                )
    return problems


def cycles(graph: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan), each sorted."""
    adj: dict[str, set[str]] = {}
    for src, dst in graph:
        adj.setdefault(src, set()).add(dst)
        adj.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return found
