"""deploy/: the Kubernetes manifests, checked offline against the schemas and the server.

- Core kinds (Deployment, Service, ConfigMap, PersistentVolumeClaim) validate strictly
  (unknown fields refused) with ``kubernetes-validate`` against Kubernetes ``K8S_VERSION``,
  whose schemas ship in the package: the tests block network connections while they run.
- The ``InferencePool`` validates against the CRD's OpenAPI v3 schema in
  ``../shared/k8s/`` with ``jsonschema``, with unknown fields refused (as
  ``kubectl apply --validate=strict`` would) and the CRD's two CEL rules checked by hand.
- The Deployment agrees with the real server: the ConfigMap's config loads with the
  server's own loader, the probe paths are routes the HTTP front serves, the ports are the
  config's, the Service and the InferencePool select the pods and target the HTTP port,
  the drain fits in the grace period and the memory limit holds the pinned host tier.
- The endpoint picker's config names the ``vllm:`` metrics the server exports.
"""

from __future__ import annotations

import copy
import socket
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from serving.deploy_config import DeploymentConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRD = ROOT.parent / "shared" / "k8s" / "inference.networking.k8s.io_inferencepools.yaml"
K8S_VERSION = "1.34.0"  # one of the versions kubernetes-validate 1.37.0 ships
CORE_KINDS = {"ConfigMap", "Deployment", "Service", "PersistentVolumeClaim"}
CONFIG_PATH = "/etc/superinfer/superinfer_config.yaml"
GIB = 1 << 30


def _docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d)
    return docs


DOCS = _docs()


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in DOCS if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any network connection fails the test: nothing may download at test time."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access during a deploy test: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _pod_spec() -> dict[str, Any]:
    return _one("Deployment")["spec"]["template"]["spec"]


def _container() -> dict[str, Any]:
    (container,) = _pod_spec()["containers"]
    return container


def _server_config(tmp_path: Path) -> DeploymentConfig:
    """The ConfigMap's file, loaded as `superinfer serve --config` loads it."""
    cm = _one("ConfigMap", "superinfer-config")
    mount = next(m for m in _container()["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in _pod_spec()["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == "superinfer-config"
    key = CONFIG_PATH.removeprefix(mount["mountPath"].rstrip("/") + "/")
    path = tmp_path / key
    path.write_text(cm["data"][key])
    return DeploymentConfig.load(path)


def _port_number(port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in _container()["ports"] if p["name"] == port)


def _quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": GIB, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * factor)
    return int(q)


# -- schemas -------------------------------------------------------------------------


def test_every_resource_is_validated() -> None:
    kinds = {d["kind"] for d in DOCS}
    assert kinds == CORE_KINDS | {"InferencePool"}, kinds


@pytest.mark.parametrize("doc", [d for d in DOCS if d["kind"] in CORE_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_core_kind_validates(doc: dict[str, Any], offline: None) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_refuses_a_misspelt_field(offline: None) -> None:
    """The check above can fail: a misspelt probe field is refused."""
    bad = copy.deepcopy(_one("Deployment"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = \
        bad["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    assert version["name"] == "v1"
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    _close(schema, top=True)
    return schema


def _close(schema: dict[str, Any], top: bool = False) -> None:
    """Refuse unknown fields wherever the schema lists properties (the API server prunes
    them; ``kubectl --validate=strict`` refuses them). ``metadata`` stays open."""
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for name, sub in schema.get("properties", {}).items():
        if not (top and name == "metadata"):
            _close(sub)
    if isinstance(schema.get("items"), dict):
        _close(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        _close(schema["additionalProperties"])


def _cel_rules(pool: dict[str, Any]) -> None:
    """The CRD's x-kubernetes-validations (CEL, not evaluated by jsonschema)."""
    ref = pool["spec"].get("endpointPickerRef")
    if ref is not None:  # rule: self.kind != 'Service' || has(self.port)
        assert ref.get("kind", "Service") != "Service" or "port" in ref, \
            "endpointPickerRef: port is required when kind is 'Service'"
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "targetPorts: port number must be unique"


def test_inference_pool_validates_against_the_crd() -> None:
    pool = _one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, _pool_schema(), cls=jsonschema.Draft202012Validator)
    _cel_rules(pool)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("targetPorts"), "'targetPorts' is a required property"),
    (lambda s: s.update(targetPort=[{"number": 8000}]), "'targetPort' was unexpected"),
    (lambda s: s["targetPorts"][0].update(number=70000), "70000 is greater than"),
    (lambda s: s["endpointPickerRef"].update(failureMode="Open"), "'Open' is not one of"),
])
def test_crd_schema_refuses_a_bad_pool(change: Any, message: str) -> None:
    bad = copy.deepcopy(_one("InferencePool"))
    change(bad["spec"])
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate(bad, _pool_schema(), cls=jsonschema.Draft202012Validator)


def test_cel_rules_can_fail() -> None:
    bad = copy.deepcopy(_one("InferencePool"))
    bad["spec"]["endpointPickerRef"].pop("port")
    with pytest.raises(AssertionError, match="port is required"):
        _cel_rules(bad)


# -- the manifests against the server -----------------------------------------------


def test_config_map_loads_with_the_server_loader(tmp_path: Path) -> None:
    config = _server_config(tmp_path)
    assert config.server.host == "0.0.0.0", "127.0.0.1 is unreachable for probes and peers"
    assert config.server.enable_http, "probes and the gateway use the HTTP front"
    assert config.get("duplex_kv.host_memory_gb") > 0
    assert config.model.path is not None and config.model.path.startswith("/models/")


def test_container_runs_serve_with_the_mounted_config(tmp_path: Path) -> None:
    from serving.cli import build_parser

    c = _container()
    assert c["command"] == ["superinfer"]
    args = build_parser("serve").parse_args(c["args"])  # the real CLI's flags
    assert args.command == "serve" and args.config == CONFIG_PATH
    _server_config(tmp_path)  # the file at that path exists in the ConfigMap and loads


def _get_routes() -> set[str]:
    from serving.http_server import OpenAIFront
    from serving.runtime import Runtime

    app = OpenAIFront(Runtime(DeploymentConfig.from_dict({}))).app
    return {r.path for r in app.routes if "GET" in getattr(r, "methods", set())}


def test_probes_hit_the_server_health_routes(tmp_path: Path) -> None:
    c, config = _container(), _server_config(tmp_path)
    routes = _get_routes()
    probes = {name: c[name]["httpGet"] for name in
              ("startupProbe", "livenessProbe", "readinessProbe")}
    for name, get in probes.items():
        assert get["path"] in routes, f"{name}: {get['path']} is not a route the server serves"
        assert _port_number(get["port"]) == config.server.http_port, name
    # readiness and start-up wait for warm-up (503 until serving); liveness does not
    assert probes["readinessProbe"]["path"] == "/health/ready"
    assert probes["startupProbe"]["path"] == "/health/ready"
    assert probes["livenessProbe"]["path"] == "/health/live"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, \
        "the startup probe must give warm-up (load + compile) at least 10 minutes"


def test_container_ports_are_the_config_ports(tmp_path: Path) -> None:
    config = _server_config(tmp_path)
    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert ports == {"http": config.server.http_port, "grpc": config.server.grpc_port}


def test_service_selects_the_pods_and_exposes_the_config_ports(tmp_path: Path) -> None:
    config, service = _server_config(tmp_path), _one("Service")
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.items() <= labels.items(), (selector, labels)
    assert _one("Deployment")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: (p["port"], _port_number(p["targetPort"]))
             for p in service["spec"]["ports"]}
    assert ports == {"http": (config.server.http_port, config.server.http_port),
                     "grpc": (config.server.grpc_port, config.server.grpc_port)}


def test_inference_pool_selects_the_pods_and_targets_http(tmp_path: Path) -> None:
    config, pool = _server_config(tmp_path), _one("InferencePool")
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items(), (selector, labels)
    assert selector == _one("Service")["spec"]["selector"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [config.server.http_port]


def test_drain_fits_in_the_grace_period(tmp_path: Path) -> None:
    config = _server_config(tmp_path)
    spec, c = _pod_spec(), _container()
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 5, "give the gateway time to stop routing before SIGTERM"
    needed = pre_stop + config.server.drain_grace_s + 10  # + exit and margin
    assert spec["terminationGracePeriodSeconds"] >= needed, \
        (spec["terminationGracePeriodSeconds"], needed)


def test_gpu_node_shm_and_pinned_memory(tmp_path: Path) -> None:
    config, spec, c = _server_config(tmp_path), _pod_spec(), _container()
    assert "GH200" in spec["nodeSelector"]["nvidia.com/gpu.product"]
    assert spec["nodeSelector"].get("kubernetes.io/arch") == "arm64"
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == "1" and requests == limits, "Guaranteed QoS"
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm["medium"] == "Memory"
    assert any(m["name"] == "dshm" and m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    host_tier = config.get("duplex_kv.host_memory_gb") * GIB
    # a memory-backed emptyDir counts against the container's limit, as pinned pages do
    needed = host_tier + _quantity(shm["sizeLimit"]) + 8 * GIB
    assert _quantity(limits["memory"]) >= needed, (limits["memory"], needed / GIB)


def test_xla_cache_dir_is_a_mounted_volume(tmp_path: Path) -> None:
    cache = _server_config(tmp_path).get("hardware.compilation_cache_dir")
    assert cache in {m["mountPath"] for m in _container()["volumeMounts"]}


# -- the endpoint picker's config ---------------------------------------------------

# llm-d-router apix/config/v1alpha1 EndpointPickerConfig's fields, and the plugin types
# used here as that repository registers them (commit bba90136f, 2026-08-18).
EPP_FIELDS = {"featureGates", "plugins", "schedulingProfiles", "dataLayer", "flowControl",
              "requestHandler", "saturationDetector", "parser"}
EPP_PLUGIN_TYPES = {"metrics-data-source", "core-metrics-extractor", "queue-scorer",
                    "kv-cache-utilization-scorer", "prefix-cache-scorer", "max-score-picker",
                    "single-profile-handler", "slo-deadline-ordering-policy"}


def _epp() -> dict[str, Any]:
    return yaml.safe_load(_one("ConfigMap", "superinfer-epp-config")["data"]["epp-config.yaml"])


def _exported_vllm_metrics() -> dict[str, set[str]]:
    """The ``vllm:`` families the server's /metrics renders, with their label names."""
    from prometheus_client.parser import text_string_to_metric_families

    from serving.metrics import ServingMetrics

    metrics = ServingMetrics("m")
    metrics.set_cache_config(16)
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_epp_config_is_well_formed() -> None:
    epp = _epp()
    assert epp["apiVersion"] == "llm-d.ai/v1alpha1" and epp["kind"] == "EndpointPickerConfig"
    assert set(epp) - {"apiVersion", "kind"} <= EPP_FIELDS, set(epp) - EPP_FIELDS
    names = {p.get("name", p["type"]) for p in epp["plugins"]}
    assert {p["type"] for p in epp["plugins"]} <= EPP_PLUGIN_TYPES
    refs = [p["pluginRef"] for prof in epp["schedulingProfiles"] for p in prof["plugins"]]
    for source in epp["dataLayer"]["sources"]:
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    refs.append(epp["flowControl"]["defaultPriorityBand"]["orderingPolicyRef"])
    assert set(refs) <= names, set(refs) - names


def test_epp_names_the_metrics_the_server_exports() -> None:
    epp = _epp()
    extractor = next(p for p in epp["plugins"] if p["type"] == "core-metrics-extractor")
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    exported = _exported_vllm_metrics()
    assert {engine["queuedRequestsSpec"], engine["runningRequestsSpec"],
            engine["kvUsageSpec"], engine["cacheInfoSpec"]} == {
        "vllm:num_requests_waiting", "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc", "vllm:cache_config_info"}
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert engine[key] in exported, f"{key}: {engine[key]} is not on /metrics"
    info_labels = exported[engine["cacheInfoSpec"]]
    assert {engine["cacheBlockSizeLabelName"], engine["cacheNumBlocksLabelName"]} <= info_labels
    # the pods carry the label that selects this mapping
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels[params["engineLabelKey"]] == engine["name"]


def test_epp_scrapes_the_pool_target_port() -> None:
    source = next(p for p in _epp()["plugins"] if p["type"] == "metrics-data-source")
    assert source["parameters"]["path"] == "/metrics" and "/metrics" in _get_routes()
    assert "port" not in source["parameters"], "metrics are on the InferencePool target port"
