"""The systemd unit, Kubernetes manifests and Dockerfile parse and agree with the server: probe
paths, shutdown timing against the drain timeout, the autoscaling metric tidal exports, session
affinity, and the image the manifests name."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tidal.config.loader import load_config
from tidal.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
UNIT = ROOT / "deploy" / "systemd" / "tidal.service"
DOCKERFILE = ROOT / "Dockerfile"

# NOTE: no schema validation against the Kubernetes OpenAPI: kubeconform and kubeval fetch the
# schemas over the network at run time and the tests have none. The checks below are structural.


def _docs() -> dict[str, dict]:
    """Every manifest by kind (one object per kind here)."""
    out: dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            key = doc["kind"] if doc["kind"] != "ConfigMap" else doc["metadata"]["name"]
            assert key not in out, f"two {key} objects"
            out[key] = doc
    return out


def _exported_names() -> set[str]:
    text = ServerMetrics().render().decode()
    return {f.name for f in text_string_to_metric_families(text)}


def _routes() -> set[str]:
    import tidal.server.app as app_module

    # Route paths as declared in the app module (building the app needs a loaded engine).
    return set(
        re.findall(r"""@app\.(?:get|post)\("([^"]+)"\)""", Path(app_module.__file__).read_text())
    )


def _tidal_config(tmp_path: Path):
    cm = _docs()["tidal-config"]
    path = tmp_path / "tidal.yaml"
    path.write_text(cm["data"]["tidal.yaml"])
    return load_config(str(path), {}, {})


def _container() -> dict:
    return _docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_all_manifests_parse_with_the_expected_kinds() -> None:
    assert set(_docs()) == {
        "Deployment",
        "Service",
        "Ingress",
        "HorizontalPodAutoscaler",
        "tidal-config",
        "prometheus-adapter-tidal-rules",
    }
    assert _docs()["HorizontalPodAutoscaler"]["apiVersion"] == "autoscaling/v2"


def test_probes_point_at_the_servers_health_and_ready_routes() -> None:
    routes = _routes()
    c = _container()
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert {"/health", "/ready", "/metrics"} <= routes
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in port_names
    assert c["command"] == ["tidal", "serve", "--config", "/etc/tidal/tidal.yaml"]


def test_the_mounted_config_loads_and_listens_where_the_probes_look(tmp_path: Path) -> None:
    cfg = _tidal_config(tmp_path)
    c = _container()
    assert cfg.server.host == "0.0.0.0"
    assert c["ports"][0]["containerPort"] == cfg.server.port
    svc = _docs()["Service"]
    assert svc["spec"]["selector"] == _docs()["Deployment"]["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_grace_period_covers_prestop_and_the_drain_timeout(tmp_path: Path) -> None:
    drain_s = _tidal_config(tmp_path).server.drain_timeout_s
    pod = _docs()["Deployment"]["spec"]["template"]["spec"]
    pre_stop = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # The kubelet counts preStop inside the grace period; SIGTERM comes after it.
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + drain_s
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_resources_have_requests_and_limits() -> None:
    res = _container()["resources"]
    assert set(res["requests"]) == {"cpu", "memory"}
    assert set(res["limits"]) == {"cpu", "memory"}


def test_hpa_scales_on_a_queue_metric_tidal_exports() -> None:
    docs = _docs()
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    adapter = yaml.safe_load(docs["prometheus-adapter-tidal-rules"]["data"]["config.yaml"])
    (rule,) = adapter["rules"]
    series = re.match(r"'?([\w:]+)\{", rule["seriesQuery"]).group(1)
    assert series == "tidal:num_requests_waiting"
    assert series in _exported_names()
    assert re.fullmatch(rule["name"]["matches"], series)
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_systemd_unit_restarts_on_failure_as_a_non_root_user() -> None:
    svc = _unit()["Service"]
    assert svc["Restart"] == "on-failure"
    assert svc["User"] not in ("", "root", "0")
    argv = svc["ExecStart"].split()
    assert argv[0].endswith("/tidal") and argv[1] == "serve"
    assert argv[argv.index("--config") + 1] == "/etc/tidal/tidal.yaml"
    assert _unit()["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.parametrize("config", [ROOT / "examples" / "tidal.yaml"])
def test_systemd_stop_timeout_exceeds_the_drain_timeout(config: Path) -> None:
    svc = _unit()["Service"]
    assert svc["KillSignal"] == "SIGTERM"
    # The unit's comments point operators at examples/tidal.yaml as the starting config.
    drain_s = load_config(str(config), {}, {}).server.drain_timeout_s
    assert float(svc["TimeoutStopSec"]) > drain_s


def test_sessions_stick_to_a_pod_at_the_service_and_the_ingress() -> None:
    docs = _docs()
    svc = docs["Service"]["spec"]
    assert svc["sessionAffinity"] == "ClientIP"
    assert svc["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] > 0
    ing = docs["Ingress"]
    assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == (
        "$http_x_session_id"
    )
    (rule,) = ing["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    backend = path["backend"]["service"]
    assert backend["name"] == docs["Service"]["metadata"]["name"]
    assert backend["port"]["name"] == docs["Service"]["spec"]["ports"][0]["name"]


def test_adapter_sums_the_replica_series_of_a_data_parallel_pod() -> None:
    adapter = yaml.safe_load(_docs()["prometheus-adapter-tidal-rules"]["data"]["config.yaml"])
    (rule,) = adapter["rules"]
    assert rule["metricsQuery"].startswith("sum by (<<.GroupBy>>)")
    names = {
        f.name
        for f in text_string_to_metric_families(ServerMetrics(num_replicas=2).render().decode())
    }
    assert "tidal:num_requests_waiting" in names  # the same name, one series per replica


def _dockerfile() -> list[list[str]]:
    """The Dockerfile's instructions, continuation lines joined, each split into words."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [line.split() for line in text.splitlines() if line.strip() and line[0] != "#"]


def test_the_dockerfile_builds_the_image_the_pods_run(tmp_path: Path) -> None:
    steps = _dockerfile()
    by_op: dict[str, list[list[str]]] = {}
    for words in steps:
        by_op.setdefault(words[0], []).append(words[1:])
    c = _container()
    assert c["image"].split(":")[0] == "tidal"  # `docker build -t tidal .` in its header
    assert "docker build -t tidal ." in DOCKERFILE.read_text()
    pod = _docs()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    (user,) = by_op["USER"]
    assert user == [f"{pod['runAsUser']}:{pod['runAsGroup']}"]
    (exposed,) = by_op["EXPOSE"]
    assert int(exposed[0]) == _tidal_config(tmp_path).server.port == c["ports"][0]["containerPort"]
    # The CPU build by default, a CUDA one by build argument; torch's version from constraints.
    assert ["DEVICE=cpu"] in by_op["ARG"]
    (install,) = [w for w in by_op["RUN"] if w[:2] == ["pip", "install"]]
    assert '"https://download.pytorch.org/whl/${DEVICE}"' in install
    assert install[install.index("-c") + 1] == "constraints.txt"
    assert install[-1] == '".${EXTRAS:+[$EXTRAS]}"' and ['EXTRAS=""'] in by_op["ARG"]
    assert (ROOT / "constraints.txt").read_text().count("torch==") == 1
    assert by_op["CMD"][0][:2] == ['["tidal",', '"serve",']


def _rayservice() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "ray" / "rayservice.yaml").read_text())


def test_the_rayservice_runs_the_serve_app_on_the_ray_image(tmp_path: Path) -> None:
    rs = _rayservice()
    assert (rs["apiVersion"], rs["kind"]) == ("ray.io/v1", "RayService")
    (application,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    module, attr = application["import_path"].split(":")
    assert (module, attr) == ("tidal.serving.ray", "app")
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file()
    # The application's settings are tidal's own environment variables, and they load.
    env = application["runtime_env"]["env_vars"]
    cfg = load_config(None, env, {})
    assert cfg.engine.hardware.data_parallel == int(env["TIDAL_HARDWARE_DATA_PARALLEL"])
    cluster = rs["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]
    ]
    for pod in pods:
        (container,) = pod["containers"]
        assert container["image"] == "tidal:ray"  # the Dockerfile with EXTRAS=ray
        assert pod["securityContext"]["runAsUser"] == 1000
    assert "--build-arg EXTRAS=ray" in DOCKERFILE.read_text()
    head_ports = {p["name"]: p["containerPort"] for p in pods[0]["containers"][0]["ports"]}
    assert head_ports["serve"] == 8000
