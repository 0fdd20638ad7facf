"""The chart as an InferencePool backend: behind a cluster's inference gateway the
chart renders the InferencePool over the engine pods, its endpoint picker (EPP) with our metric names
mapped, and an OpenAI front in each engine pod; our own gateway is off. No cluster runs here: every
object is validated against its schema (the Kubernetes built-ins with kubernetes-validate, the
InferencePool against its CRD's openAPIV3Schema vendored in tests/helm/schemas, since
kubernetes-validate knows built-in kinds only), and the EPP's configuration against the field names
of llm-d-router's Go types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from pagedserve.drain import COMPUTE_STOP_S, GATEWAY_STOP_S, MEMORY_STOP_S
from tests.helm.chart import NAMESPACE, Rendered, container, engine_pod, flag, lint, mounts, render
from tests.helm.test_chart import KUBE_VERSION

POOL_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "inferencepool-v1.json").read_text())
METRICS_SOURCE = Path(__file__).parents[2] / "compute_service" / "service" / "metrics.py"

# llm-d-router (github.com/llm-d/llm-d-router at ebab687, 2026-08-22), the json names of the types its
# EPP decodes strictly: apix/config/v1alpha1/endpointpickerconfig_types.go, and the parameters of the
# two data-layer plugins we configure (pkg/epp/framework/plugins/datalayer/.../metrics).
EPP_CONFIG_FIELDS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer",
                     "flowControl", "requestHandler", "saturationDetector", "parser"}
PLUGIN_FIELDS = {"name", "type", "parameters"}
METRICS_SOURCE_FIELDS = {"scheme", "path", "port", "insecureSkipVerify", "caCertPath", "clientCertPath",
                         "clientKeyPath", "interval"}
EXTRACTOR_FIELDS = {"engineLabelKey", "defaultEngine", "engineConfigs"}
ENGINE_CONFIG_FIELDS = {"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec",
                        "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec",
                        "cacheNumBlocksSpec", "customMetrics"}
ENGINE_LABEL_KEY = "llm-d.ai/engine-type"  # the extractor's default engineLabelKey

POOL = {"inferencePool": {"enabled": True}, "gateway": {"httpAllowedHosts": ["llm.example.com"]}}
VALUE_SETS = {
    "pool": POOL,
    "pool-keys-cpu": {"inferencePool": {"enabled": True, "from": [{"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}]},
        "gateway": {"apiKeys": {"secretName": "keys"}}, "gpu": {"mode": "none"}, "engine": {"replicas": 3}},
    "pool-and-our-gateway": {**POOL, "gateway": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    "pool-external-epp": {"inferencePool": {"enabled": True, "endpointPicker": {
        "enabled": False, "serviceName": "shared-epp", "port": 9100}}},
}


def validate_custom_resource(obj: dict[str, Any], schema: dict[str, Any]) -> None:
    """As the API server would with strict field validation: the structural schema (types, enums,
    bounds, required), no field the schema does not name, and the CRD's two CEL rules by hand."""
    jsonschema.validate(obj, schema)
    assert_known_fields(obj, schema, obj["kind"])
    spec = obj["spec"]
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref, "port is required when kind is 'Service'"
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert len(set(numbers)) == len(numbers), "port number must be unique"


def assert_known_fields(value: Any, schema: dict[str, Any], path: str) -> None:
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            assert key in schema["properties"], f"{path}.{key}: unknown field"
            assert_known_fields(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            assert_known_fields(item, schema["items"], f"{path}[{i}]")


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def case(request: pytest.FixtureRequest) -> tuple[str, dict, Rendered]:
    return request.param, VALUE_SETS[request.param], render(VALUE_SETS[request.param])


def test_lint_is_clean(case) -> None:
    _, values, _ = case
    assert lint(values) == []


def test_every_object_is_valid(case) -> None:
    _, _, rendered = case
    assert "InferencePool" in rendered.kinds()
    for obj in rendered.objects:
        if obj["kind"] == "InferencePool":
            assert obj["apiVersion"] == "inference.networking.k8s.io/v1"
            validate_custom_resource(obj, POOL_SCHEMA)
        elif obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD the Prometheus Operator validates; test_chart checks its shape
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_the_vendored_schema_refuses_what_the_api_server_would() -> None:
    """The check above can fail: a wrong field, a bad port, a missing selector."""
    good = render(POOL).one("InferencePool")
    for broken in ({"targetPort": [{"number": 8000}]}, {"targetPorts": [{"number": 0}]}, {"selector": None},
                   {"appProtocol": "grpc"}):
        spec = {k: v for k, v in {**good["spec"], **broken}.items() if v is not None}
        with pytest.raises((jsonschema.ValidationError, AssertionError)):
            validate_custom_resource({**good, "spec": spec}, POOL_SCHEMA)


def test_the_pool_selects_the_engine_pods_and_targets_their_openai_front(case) -> None:
    _, values, rendered = case
    pool = rendered.one("InferencePool")["spec"]
    engine = rendered.one("Deployment", "-engine")
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["selector"]["matchLabels"] == engine["spec"]["selector"]["matchLabels"]
    assert pod_labels[ENGINE_LABEL_KEY] == "pagedserve"
    front = container(engine_pod(rendered), "openai")
    assert pool["targetPorts"] == [{"number": 8000}]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in front["ports"]
    assert pool["appProtocol"] == "http"  # the front speaks OpenAI HTTP/1.1
    # The picker the pool names is a Service on the port it names.
    ref = pool["endpointPickerRef"]
    external = values["inferencePool"].get("endpointPicker", {})
    if external.get("enabled") is False:
        assert ref == {"name": "shared-epp", "port": {"number": 9100}, "failureMode": "FailClose"}
        assert not [o for o in rendered.objects if o["metadata"]["name"].endswith("-epp") and o["kind"] != "ConfigMap"]
        return
    service = rendered.one("Service", "-epp")
    assert ref["name"] == service["metadata"]["name"]
    [port] = service["spec"]["ports"]
    assert ref["port"] == {"number": port["port"]} and port["appProtocol"] == "kubernetes.io/h2c"
    epp = rendered.one("Deployment", "-epp")
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    [picker] = epp["spec"]["template"]["spec"]["containers"]
    assert flag(picker, "--pool-name") == rendered.one("InferencePool")["metadata"]["name"]
    assert flag(picker, "--pool-namespace") == NAMESPACE
    assert flag(picker, "--pool-group") == "inference.networking.k8s.io"
    assert flag(picker, "--grpc-port") == str(port["port"])
    config_file = flag(picker, "--config-file")
    assert mounts(picker)["config"] == str(Path(config_file).parent)
    [volume] = epp["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == rendered.one("ConfigMap", "-epp")["metadata"]["name"]
    assert Path(config_file).name in rendered.one("ConfigMap", "-epp")["data"]
    # It reads pods and its pool in this namespace, nothing cluster-wide.
    role = rendered.one("Role", "-epp")
    assert {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
            "verbs": ["get", "watch", "list"]} in role["rules"]
    assert rendered.one("RoleBinding", "-epp")["roleRef"]["name"] == role["metadata"]["name"]
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == rendered.one("ServiceAccount", "-epp")[
        "metadata"]["name"]
    assert not [o for o in rendered.objects if o["kind"].startswith("Cluster")]


def test_the_epp_config_maps_our_metric_names(case) -> None:
    """The EndpointPickerConfig in the ConfigMap: only fields llm-d-router's strict decoder knows, our
    compute service's metric names for the engine type the pods are labelled with, scraped on the
    compute service's metrics port, every pluginRef defined."""
    _, _, rendered = case
    [text] = rendered.one("ConfigMap", "-epp")["data"].values()
    config = yaml.safe_load(text)
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    assert set(config) <= EPP_CONFIG_FIELDS
    plugins = {p["type"]: p for p in config["plugins"]}
    assert all(set(p) <= PLUGIN_FIELDS for p in config["plugins"])
    source = plugins["metrics-data-source"]["parameters"]
    assert set(source) <= METRICS_SOURCE_FIELDS
    compute = container(engine_pod(rendered), "compute")
    assert source["port"] == int(flag(compute, "--metrics-port")) and source["path"] == "/metrics"
    extractor = plugins["core-metrics-extractor"]["parameters"]
    assert set(extractor) <= EXTRACTOR_FIELDS
    [engine] = extractor["engineConfigs"]
    assert set(engine) <= ENGINE_CONFIG_FIELDS
    pod_labels = rendered.one("Deployment", "-engine")["spec"]["template"]["metadata"]["labels"]
    assert engine["name"] == pod_labels[ENGINE_LABEL_KEY] == extractor["defaultEngine"]
    exported = METRICS_SOURCE.read_text()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert f'"{engine[key]}"' in exported, f"{engine[key]} is not a compute service metric"
    assert "loraSpec" not in engine  # no adapters: the extractor skips LoRA
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= names
    # A changed configuration rolls the picker (it reads the file once at start).
    if "Deployment" in [o["kind"] for o in rendered.objects if o["metadata"]["name"].endswith("-epp")]:
        assert rendered.one("Deployment", "-epp")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def test_each_engine_pod_has_an_openai_front_for_its_own_compute_service(case) -> None:
    _, values, rendered = case
    pod = engine_pod(rendered)
    front, compute = container(pod, "openai"), container(pod, "compute")
    assert front["command"] == ["python", "-m", "gateway"]
    assert flag(front, "--backend") == "127.0.0.1:50052" and flag(compute, "--listen") == "0.0.0.0:50052"
    assert flag(front, "--listen").startswith("127.0.0.1:")  # its gRPC API stays inside the pod
    assert (flag(front, "--http-host"), flag(front, "--http-port")) == ("0.0.0.0", "8000")
    assert flag(front, "--backend-token-file") == flag(compute, "--auth-token-file")
    assert mounts(front)["service-token"] == mounts(compute)["service-token"]
    assert "memory-token" not in mounts(front)  # only compute talks to the memory service
    assert front["image"] == "pagedserve:0.1.0-cpu"  # no GPU needed
    # Keys and Host names are the gateway's settings.
    keys = values.get("gateway", {}).get("apiKeys", {}).get("secretName")
    if keys:
        assert flag(front, "--api-keys-file") == "/etc/pagedserve/api-keys/api-keys"
        assert {"name": "api-keys", "secret": {"secretName": keys}} in pod["volumes"]
    else:
        assert "--api-keys-file" not in front["args"]
    hosts = [front["args"][i + 1] for i, a in enumerate(front["args"]) if a == "--http-allowed-hosts"]
    assert hosts == values.get("gateway", {}).get("httpAllowedHosts", [])
    # Ready only while /health says so (503 until compute is ready and from SIGTERM on).
    assert front["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # It drains beside compute, for the engine's drain timeout, after the same preStop sleep; the pod's
    # grace period still covers it (the memory sidecar stops after both).
    assert flag(front, "--grace-period-s") == flag(compute, "--shutdown-grace-s") == "30"
    assert front["lifecycle"] == compute["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert GATEWAY_STOP_S <= COMPUTE_STOP_S
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + COMPUTE_STOP_S + MEMORY_STOP_S
    sc = front["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert mounts(front)["tmp"] == "/tmp"


def test_the_engine_policy_admits_the_pools_proxies_and_picker(case) -> None:
    _, values, rendered = case
    rules = rendered.one("NetworkPolicy", "-engine")["spec"]["ingress"]
    [front_rule] = [r for r in rules if {"port": 8000, "protocol": "TCP"} in r["ports"]]
    peers = values["inferencePool"].get("from")
    assert front_rule.get("from") == peers  # none: anyone, as a public API
    metrics_rules = [r for r in rules if r["ports"] == [{"port": 9091, "protocol": "TCP"}]]
    if values["inferencePool"].get("endpointPicker", {}).get("enabled") is False:
        assert metrics_rules == []  # an EPP of one's own: engine.networkPolicy.metricsFrom admits it
        return
    [rule] = metrics_rules
    [peer] = rule["from"]
    epp_labels = rendered.one("Deployment", "-epp")["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= epp_labels.items()


def test_our_gateway_is_off_behind_the_pool_unless_asked_for() -> None:
    def gateway_objects(rendered: Rendered) -> list[str]:
        return sorted(f"{o['kind']}/{o['metadata']['name']}" for o in rendered.objects
                      if o["metadata"]["name"].startswith("demo-pagedserve-gateway"))

    behind = render({**POOL, "serviceMonitor": {"enabled": True},
                     "gateway": {"autoscaling": {"enabled": True}, "podDisruptionBudget": {"enabled": True},
                                 "tls": {"enabled": True, "certificate": "C", "privateKey": "K", "serverName": "n"}}})
    assert gateway_objects(behind) == []
    assert [m["metadata"]["name"] for m in behind.objects if m["kind"] == "ServiceMonitor"] == [
        "demo-pagedserve-engine"]
    assert "port-forward svc/demo-pagedserve-gateway" not in behind.notes
    assert "kind: InferencePool, name: demo-pagedserve-engine" in behind.notes
    both = render({**POOL, "gateway": {"enabled": True}})
    assert gateway_objects(both) == ["Deployment/demo-pagedserve-gateway", "NetworkPolicy/demo-pagedserve-gateway",
                                     "Service/demo-pagedserve-gateway", "Service/demo-pagedserve-gateway-metrics"]
    # Without the pool: our gateway as before, and nothing of the pool.
    plain = render({})
    assert len(gateway_objects(plain)) == 4
    assert not {"InferencePool", "Role", "RoleBinding", "ServiceAccount"} & set(plain.kinds())
    assert [c["name"] for c in engine_pod(plain)["containers"]] == ["compute"]
    assert ENGINE_LABEL_KEY not in plain.one("Deployment", "-engine")["spec"]["template"]["metadata"]["labels"]
    assert gateway_objects(render({"gateway": {"enabled": False}})) == []


def test_an_external_picker_needs_its_service_name() -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        render({"inferencePool": {"enabled": True, "endpointPicker": {"enabled": False}}})
    assert "/inferencePool/endpointPicker" in str(info.value) and "serviceName" in str(info.value)
    with pytest.raises(helm.HelmValuesError) as info:
        render({"inferencePool": {"enabled": True, "engineType": "not a label value"}})
    assert "/inferencePool/engineType" in str(info.value)
