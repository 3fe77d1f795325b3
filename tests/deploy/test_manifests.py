"""deploy/: the Kubernetes manifests, checked offline against the schemas and the server.

- Core kinds (Deployment, Service, ConfigMap, PersistentVolumeClaim) validate strictly
  (unknown fields refused) with ``kubernetes-validate`` against Kubernetes ``K8S_VERSION``,
  whose schemas ship in the package: the tests block network connections while they run.
- The ``InferencePool`` validates against the CRD's OpenAPI v3 schema in ``crds/``
  (vendored; source and licence in ``crds/README.md``) with ``jsonschema``, with unknown
  fields refused (as ``kubectl apply --validate=strict`` would) and the CRD's two CEL
  rules checked by hand.
- The Deployment agrees with the real server: the ConfigMap's config loads with the
  server's own loader, the probe paths are routes the HTTP front serves, the ports are the
  config's, the Service and the InferencePool select the pods and target the HTTP port,
  the drain fits in the grace period and the memory limit holds the pinned host tier.
- The endpoint picker's config names the ``vllm:`` metrics the server exports.
- ``deploy/multihost`` (a LeaderWorkerSet, several hosts per replica): its ConfigMap and
  Service and both pod templates (as core ``PodTemplate``s) validate strictly with
  ``kubernetes-validate``; the LeaderWorkerSet's own fields against a hand-written
  subset of the LWS API (``leaderworkerset_subset.schema.yaml``, its source commit cited
  there) and the admission webhook's rules in Python; LWS's variables expand into the
  group flags the real CLI parses (coordinator, process count, process id); the mesh
  spans every GPU of the group; the leader's probes and ports are the server's, the
  workers bind nothing and outlast the leader's drain.
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
CRD = Path(__file__).with_name("crds") / "inference.networking.k8s.io_inferencepools.yaml"
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


# -- several hosts per replica: deploy/multihost (a LeaderWorkerSet) -------------------

MULTIHOST = DEPLOY / "multihost"
LWS_SUBSET = Path(__file__).with_name("leaderworkerset_subset.schema.yaml")
COORDINATOR_PORT = 8476


def _multihost_docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((MULTIHOST / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((MULTIHOST / name).read_text()) if d)
    return docs


MH_DOCS = _multihost_docs()
MH_CORE = [d for d in MH_DOCS if d["kind"] in CORE_KINDS]


def _lws() -> dict[str, Any]:
    (lws,) = [d for d in MH_DOCS if d["kind"] == "LeaderWorkerSet"]
    return lws


def _templates() -> dict[str, dict[str, Any]]:
    group = _lws()["spec"]["leaderWorkerTemplate"]
    return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}


def _mh_container(role: str) -> dict[str, Any]:
    (container,) = _templates()[role]["spec"]["containers"]
    return container


def _lws_schema() -> dict[str, Any]:
    return yaml.safe_load(LWS_SUBSET.read_text())


def test_multihost_resources_are_validated() -> None:
    assert {d["kind"] for d in MH_DOCS} == {"ConfigMap", "Service", "LeaderWorkerSet"}


@pytest.mark.parametrize("doc", MH_CORE, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_multihost_core_kind_validates(doc: dict[str, Any], offline: None) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_lws_pod_templates_validate_as_core_pod_templates(role: str, offline: None) -> None:
    template = {"apiVersion": "v1", "kind": "PodTemplate",
                "metadata": {"name": f"superinfer-multihost-{role}"},
                "template": _templates()[role]}
    kubernetes_validate.validate(template, K8S_VERSION, strict=True)


def _lws_webhook_rules(lws: dict[str, Any]) -> None:
    """What LWS's admission webhook refuses beyond the schema (generalValidate)."""
    spec = lws["spec"]
    size, replicas = spec["leaderWorkerTemplate"].get("size", 1), spec.get("replicas", 1)
    assert size >= 1, "size must be equal or greater than 1"
    assert replicas * size <= 2**31 - 1, "the product of replicas and size is too large"
    rolling = spec.get("rolloutStrategy", {}).get("rollingUpdateConfiguration", {})
    assert (rolling.get("maxUnavailable", 1), rolling.get("maxSurge", 0)) != (0, 0) \
        or replicas == 0, "maxUnavailable must not be 0 when maxSurge is 0"


def test_leaderworkerset_validates_against_the_lws_api() -> None:
    lws = _lws()
    jsonschema.validate(lws, _lws_schema(), cls=jsonschema.Draft202012Validator)
    _lws_webhook_rules(lws)


@pytest.mark.parametrize("change, message", [
    (lambda s: s["leaderWorkerTemplate"].update(restartPolicy="RecreateGroup"),
     "'RecreateGroup' is not one of"),
    (lambda s: s["leaderWorkerTemplate"].update(sizee=2), "'sizee' was unexpected"),
    (lambda s: s["leaderWorkerTemplate"].update(size="2"), "'2' is not of type 'integer'"),
    (lambda s: s["leaderWorkerTemplate"].pop("workerTemplate"),
     "'workerTemplate' is a required property"),
    (lambda s: s.update(startupPolicy="LeaderStarted"), "'LeaderStarted' is not one of"),
])
def test_lws_schema_refuses_a_bad_leaderworkerset(change: Any, message: str) -> None:
    bad = copy.deepcopy(_lws())
    change(bad["spec"])
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate(bad, _lws_schema(), cls=jsonschema.Draft202012Validator)


def test_lws_webhook_rules_can_fail() -> None:
    bad = copy.deepcopy(_lws())
    bad["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"].update(maxUnavailable=0)
    with pytest.raises(AssertionError, match="maxUnavailable must not be 0"):
        _lws_webhook_rules(bad)


def test_lws_recreates_the_group_and_starts_workers_with_the_leader() -> None:
    spec = _lws()["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # LeaderReady would never start the workers: the leader is ready once they joined
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of container args."""
    out = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


def test_lws_variables_become_the_group_flags(tmp_path: Path) -> None:
    from serving.cli import build_parser
    from serving.group import group_config

    size = _lws()["spec"]["leaderWorkerTemplate"]["size"]
    leader, worker = _mh_container("leader"), _mh_container("worker")
    assert leader["command"] == worker["command"] == ["superinfer"]
    assert leader["args"] == worker["args"], "every process runs the same command"
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports["coordinator"] == COORDINATOR_PORT
    for index in range(size):  # what LWS sets in each pod of group 0
        env = {"LWS_LEADER_ADDRESS": "superinfer-multihost-0.superinfer-multihost.default",
               "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
        args = build_parser("serve").parse_args(_expand(leader["args"], env))
        assert "$(" not in " ".join(_expand(leader["args"], env))
        dist = group_config(args, {})
        assert dist is not None
        assert dist.coordinator == f"{env['LWS_LEADER_ADDRESS']}:{ports['coordinator']}"
        assert (dist.num_processes, dist.process_id) == (size, index)
        assert args.config == CONFIG_PATH


def _multihost_config(tmp_path: Path) -> DeploymentConfig:
    (cm,) = [d for d in MH_CORE if d["kind"] == "ConfigMap"]
    for role in ("leader", "worker"):
        spec = _templates()[role]["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "config")
        assert volume["configMap"]["name"] == cm["metadata"]["name"], "one file for all"
        mount = next(m for m in _mh_container(role)["volumeMounts"] if m["name"] == "config")
        assert CONFIG_PATH.startswith(mount["mountPath"].rstrip("/") + "/")
    key = CONFIG_PATH.rsplit("/", 1)[1]
    path = tmp_path / key
    path.write_text(cm["data"][key])
    return DeploymentConfig.load(path)


def test_multihost_config_spans_every_gpu_of_the_group(tmp_path: Path) -> None:
    config = _multihost_config(tmp_path)
    size = _lws()["spec"]["leaderWorkerTemplate"]["size"]
    gpus = {role: int(_mh_container(role)["resources"]["limits"]["nvidia.com/gpu"])
            for role in ("leader", "worker")}
    assert gpus["leader"] == gpus["worker"]
    assert config.engine.model.tensor_parallel_size == size * gpus["leader"], \
        "the mesh must span every process's devices"
    assert config.server.host == "0.0.0.0" and config.server.enable_http
    assert config.model.path is not None and config.model.path.startswith("/models/")


def test_multihost_leader_probes_ports_and_drain(tmp_path: Path) -> None:
    config, leader = _multihost_config(tmp_path), _mh_container("leader")
    routes = _get_routes()
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert (ports["http"], ports["grpc"]) == (config.server.http_port,
                                              config.server.grpc_port)
    expected = {"startupProbe": "/health/ready", "livenessProbe": "/health/live",
                "readinessProbe": "/health/ready"}
    for name, path in expected.items():
        get = leader[name]["httpGet"]
        assert get["path"] == path and path in routes, name
        assert ports[get["port"]] == config.server.http_port, name
    startup = leader["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600 + 600, \
        "the group's init timeout (600 s) plus warm-up"
    spec = _templates()["leader"]["spec"]
    pre_stop = leader["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + config.server.drain_grace_s + 10


def test_multihost_worker_serves_nothing_and_outlasts_the_drain() -> None:
    worker = _mh_container("worker")
    assert not {"ports", "startupProbe", "livenessProbe", "readinessProbe",
                "lifecycle"} & set(worker), "a worker binds nothing and must not leave early"
    grace = {role: _templates()[role]["spec"]["terminationGracePeriodSeconds"]
             for role in ("leader", "worker")}
    assert grace["worker"] >= grace["leader"], "it replays until the leader ends the group"


def test_multihost_service_selects_the_leaders(tmp_path: Path) -> None:
    (service,) = [d for d in MH_CORE if d["kind"] == "Service"]
    selector = service["spec"]["selector"]
    assert selector == {"leaderworkerset.sigs.k8s.io/name": _lws()["metadata"]["name"],
                        "leaderworkerset.sigs.k8s.io/worker-index": "0"}  # LWS's pod labels
    leader_ports = {p["name"] for p in _mh_container("leader")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= leader_ports


def test_multihost_uses_the_base_model_volume() -> None:
    claim = _one("PersistentVolumeClaim")["metadata"]["name"]
    for role in ("leader", "worker"):
        volume = next(v for v in _templates()[role]["spec"]["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"]["claimName"] == claim
