"""The Grafana dashboard and the documented PromQL use only metrics and labels the server exports."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidal.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tidal-dashboard.json"
DOCS_WITH_PROMQL = (ROOT / "docs" / "serving.md", ROOT / "README.md")

# Labels Prometheus attaches to every scraped series; the exposition never carries them.
TARGET_LABELS = frozenset({"instance", "job"})
# The sample-name suffixes prometheus_client writes for each family type.
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}
_PROMQL_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan"}
)
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", re.IGNORECASE
)
_RANGE = re.compile(r"\[[^\]]*\]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL expression, where it came from, and the names it references."""

    where: str
    expr: str
    metrics: tuple[str, ...]
    labels: frozenset[str]


def parse_promql(where: str, expr: str) -> Query:
    """Metric names and label names an expression references (enough PromQL for dashboards)."""
    labels: set[str] = set()
    for body in _MATCHERS.findall(expr):
        labels.update(m.group(1) for m in re.finditer(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", body))
    for body in _GROUPING.findall(expr):
        labels.update(part.strip() for part in body.split(",") if part.strip())
    rest = _STRING.sub(" ", expr)
    rest = _MATCHERS.sub(" ", rest)
    rest = _GROUPING.sub(" ", rest)
    rest = _RANGE.sub(" ", rest)
    metrics = []
    for m in _IDENT.finditer(rest):
        word = m.group(0)
        before = rest[m.start() - 1] if m.start() else " "
        after = rest[m.end() :].lstrip()[:1]
        # Skip functions and aggregations (followed by "("), keywords, and exponents/units of numbers.
        if after == "(" or word.lower() in _PROMQL_KEYWORDS or before.isdigit() or before == ".":
            continue
        metrics.append(word)
    return Query(where, expr, tuple(metrics), frozenset(labels))


def exported_families() -> dict[str, Family]:
    """The families in the /metrics exposition of a server's ServerMetrics, labelled ones observed
    the way the server observes them so their label names show."""
    metrics = ServerMetrics(target_ttft_ms=1000, target_tpot_ms=100)  # with batching targets set
    metrics.track().finish("stop")  # what GenerationJob does when a request ends
    metrics.observe_slo(0.5, 0.05)  # what a RequestTracker does when a request finishes
    metrics.step_cost.labels(term="base").set(0.01)  # what on_step does each step
    metrics.rejected.labels(reason="queue_full").inc()  # what app.py does for a 429
    metrics.requests_failed.labels(reason="engine_died").inc()  # what cli_serve.py wires up
    metrics.replica(0).routed("load")  # what the data-parallel router reports
    metrics.constrained_requests.labels(kind="json").inc()  # what GenerationJob does for one
    text = metrics.render().decode()
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
        labels = frozenset(k for s in fam.samples for k in s.labels)
        out[fam.name] = Family(fam.name, fam.type, labels)
    return out


def resolve(name: str, families: dict[str, Family]) -> tuple[Family, str] | None:
    """The family a sample name belongs to and its suffix, by prometheus_client's naming rules."""
    for fam in families.values():
        for suffix in SUFFIXES.get(fam.type, ()):
            if name == fam.name + suffix:
                return fam, suffix
    return None


def dashboard_queries(dashboard: dict) -> list[Query]:
    queries = []
    for panel in _all_panels(dashboard["panels"]):
        for t in panel.get("targets", []):
            queries.append(parse_promql(f"panel {panel['title']!r} {t['refId']}", t["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
            assert m is not None, f"variable {var['name']}: unexpected query {q!r}"
            inner = parse_promql(f"variable {var['name']}", m.group(1))
            queries.append(
                Query(inner.where, q, inner.metrics, inner.labels | frozenset({m.group(2)}))
            )
    return queries


def documented_queries() -> list[Query]:
    """Every line of every ```promql block in the user docs."""
    out = []
    for path in DOCS_WITH_PROMQL:
        text = path.read_text(encoding="utf-8")
        for block in re.findall(r"```promql\n(.*?)```", text, re.DOTALL):
            for line in block.splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    out.append(parse_promql(f"{path.name}", line.strip()))
    return out


def _all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_all_panels(p.get("panels", [])))
    return out


@pytest.fixture(scope="module")
def families() -> dict[str, Family]:
    return exported_families()


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def check_queries(queries: list[Query], families: dict[str, Family]) -> None:
    assert queries
    for q in queries:
        assert q.metrics, f"{q.where}: no metric in {q.expr!r}"
        known_labels = set(TARGET_LABELS)
        for name in q.metrics:
            found = resolve(name, families)
            assert found is not None, (
                f"{q.where}: {name!r} is not exported by the server "
                f"(families: {sorted(f'{f.name} ({f.type})' for f in families.values())})"
            )
            fam, suffix = found
            known_labels |= fam.labels
            # Counters and histogram series only make sense as rates; gauges never.
            in_rate = re.search(rf"\b(?:rate|irate|increase)\(\s*{re.escape(name)}\b", q.expr)
            if fam.type in ("counter", "histogram"):
                assert in_rate, f"{q.where}: {name} must be read through rate() in {q.expr!r}"
            else:
                assert not in_rate, f"{q.where}: rate() of the gauge {name} in {q.expr!r}"
            if suffix == "_bucket":
                grouped_by_le = re.search(r"\bby\s*\(([^)]*\b)?le\b", q.expr)
                assert "histogram_quantile(" in q.expr and grouped_by_le, (
                    f"{q.where}: {name} needs histogram_quantile(q, sum by (le) (rate(...)))"
                )
        unknown = q.labels - known_labels
        assert not unknown, f"{q.where}: labels {sorted(unknown)} not on any series of {q.expr!r}"


def test_parse_promql_finds_metrics_and_labels() -> None:
    q = parse_promql(
        "t",
        'histogram_quantile(0.99, sum by (le) (rate(tidal:x_bucket{instance=~"a:b"}[5m]))) '
        "/ 1e3 + sum without (job) (tidal:y) * on(instance) group_left tidal:z_total",
    )
    assert q.metrics == ("tidal:x_bucket", "tidal:y", "tidal:z_total")
    assert q.labels == {"le", "instance", "job"}


def test_resolve_follows_prometheus_client_suffixes(families: dict[str, Family]) -> None:
    assert resolve("tidal:request_success_total", families) == (
        families["tidal:request_success"],
        "_total",
    )
    assert resolve("tidal:request_success", families) is None  # a counter needs _total
    assert resolve("tidal:time_to_first_token_seconds_bucket", families) is not None
    assert resolve("tidal:time_to_first_token_seconds", families) is None
    assert resolve("tidal:kv_cache_usage_ratio", families) is not None
    assert resolve("tidal:kv_cache_usage_ratio_total", families) is None
    assert families["tidal:request_rejected"].labels == {"reason"}
    assert families["tidal:request_success"].labels == {"finished_reason"}


def test_dashboard_uses_only_exported_metrics(dashboard: dict, families: dict[str, Family]) -> None:
    check_queries(dashboard_queries(dashboard), families)


def test_dashboard_shows_every_tidal_metric(dashboard: dict, families: dict[str, Family]) -> None:
    used = {resolve(n, families)[0].name for q in dashboard_queries(dashboard) for n in q.metrics}  # type: ignore[index]
    exported = {f.name for f in families.values() if f.type in SUFFIXES} - {
        f.name for f in families.values() if f.name.endswith("_created")
    }
    assert exported - used == set(), "metrics with no panel: add them to the dashboard"


def test_documented_promql_uses_only_exported_metrics(families: dict[str, Family]) -> None:
    queries = documented_queries()
    names = {n for q in queries for n in q.metrics}
    assert "tidal:time_to_first_token_seconds_bucket" in names
    assert "tidal:e2e_request_latency_seconds_bucket" in names
    check_queries(queries, families)


def test_dashboard_shape(dashboard: dict) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = _all_panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    # No two panels overlap on the 24-column grid.
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
