"""The Helm chart renders, lints and validates against the Kubernetes schemas for every value set,
and its objects have the structure the services rely on."""

from __future__ import annotations

import base64
import posixpath

import helm_python as helm
import kubernetes_validate
import pytest

from pagedserve.drain import COMPUTE_STOP_S, GATEWAY_STOP_S, MEMORY_STOP_S
from tests.helm.chart import NAMESPACE, container, engine_pod, env, flag, gateway_pod, lint, mounts, render

KUBE_VERSION = "1.34.0"  # first release with resource.k8s.io/v1 (DRA) enabled by default

VALUE_SETS = {
    "default": {},
    "gpu-dra-pvc": {"gpu": {"mode": "dra"},
                    "model": {"source": "pvc", "pvc": {"claimName": "models", "path": "llama-3b"}}},
    "gpu-device-plugin": {"gpu": {"mode": "device-plugin"}},
    "cpu-download": {
        "gpu": {"mode": "none"}, "engine": {"shmSizeLimit": "3Gi"},
        "model": {"source": "download", "download": {"repo": "HuggingFaceTB/SmolLM2-360M-Instruct",
                                                     "tokenSecret": {"name": "hf"}}},
    },
    "multi-replica": {
        "engine": {"replicas": 4}, "cache": {"existingClaim": "pagedserve-cache"},
        "gateway": {"replicas": 3, "autoscaling": {"enabled": True}, "podDisruptionBudget": {"enabled": True},
                    "apiKeys": {"secretName": "gateway-keys"}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "kv-tier-emptydir": {"gpu": {"mode": "none"}, "engine": {"memory": {"kvTier": {"enabled": True}}}},
    "kv-tier-pvc": {"engine": {"memory": {"kvTier": {"enabled": True, "existingClaim": "kv-tier",
                                                    "bytes": 100 << 30, "hostBytes": 1 << 30}}}},
}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def case(request: pytest.FixtureRequest):
    return request.param, VALUE_SETS[request.param], render(VALUE_SETS[request.param])


def test_lint_is_clean(case) -> None:
    _, values, _ = case
    assert lint(values) == []


def test_every_object_is_valid_kubernetes(case) -> None:
    _, _, rendered = case
    for obj in rendered.objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):  # a CRD: no built-in schema
            assert obj["kind"] == "ServiceMonitor"
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_engine_containers_share_socket_shm_and_cache(case) -> None:
    _, values, rendered = case
    pod = engine_pod(rendered)
    memory, compute = container(pod, "memory"), container(pod, "compute")
    assert pod["shareProcessNamespace"] is True
    # Memory is a native sidecar: up before compute starts, stopped after compute has drained.
    assert [c["name"] for c in pod["containers"]] == ["compute"]
    assert pod["initContainers"][-1]["name"] == "memory"
    assert memory["restartPolicy"] == "Always"
    # The one socket path, on both sides, inside the directory both mount from one emptyDir.
    socket = flag(memory, "--socket")
    assert socket == flag(compute, "--memory-socket") == "/run/pagedserve/memory/memory.sock"
    for c in (memory, compute):
        # A private subdirectory of the mount (the memory service creates it 0700): the emptyDir
        # itself is world-writable, which the memory service refuses for its socket.
        assert mounts(c)["socket"] == posixpath.dirname(posixpath.dirname(socket))
        assert mounts(c)["dshm"] == "/dev/shm"
        assert mounts(c)["cache"] == env(c)["PAGEDSERVE_CACHE_DIR"]
        assert mounts(c)["tmp"] == "/tmp"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["socket"] == {"name": "socket", "emptyDir": {}}
    expected_shm = values.get("engine", {}).get("shmSizeLimit", "2Gi")
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": expected_shm}
    claim = values.get("cache", {}).get("existingClaim")
    if claim:
        assert volumes["cache"]["persistentVolumeClaim"] == {"claimName": claim}
    else:
        assert "emptyDir" in volumes["cache"]


@pytest.mark.parametrize("drain", [None, {"preStopSeconds": 0, "timeoutSeconds": 120}])
def test_grace_periods_are_the_drain_bound(drain: dict | None) -> None:
    """preStop sleep, then SIGTERM: the drain timeout is each service's flag, and the pod's grace
    period covers preStop + drain + the stop times pagedserve/drain.py states (the tests of the drain
    measure those on real processes), nothing less: the kubelet's SIGKILL never cuts a drain short."""
    values = {"engine": {"drain": drain}, "gateway": {"drain": drain}} if drain else {}
    rendered = render(values)
    expected = drain or {"preStopSeconds": 5, "timeoutSeconds": 30}
    for pod, name, flag_name, stop_s in (
            (engine_pod(rendered), "compute", "--shutdown-grace-s", COMPUTE_STOP_S + MEMORY_STOP_S),
            (gateway_pod(rendered), "gateway", "--grace-period-s", GATEWAY_STOP_S)):
        c = container(pod, name)
        assert flag(c, flag_name) == str(expected["timeoutSeconds"])
        assert pod["terminationGracePeriodSeconds"] == expected["preStopSeconds"] + expected["timeoutSeconds"] + stop_s
        if expected["preStopSeconds"]:
            assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": expected["preStopSeconds"]}}}
        else:
            assert "lifecycle" not in c
    # The memory sidecar has no preStop: it must outlive the compute container's drain, not sleep.
    assert "lifecycle" not in container(engine_pod(rendered), "memory")


def test_probes_are_grpc_health_with_a_generous_startup(case) -> None:
    _, _, rendered = case
    pod = engine_pod(rendered)
    compute = container(pod, "compute")
    assert flag(compute, "--listen") == "0.0.0.0:50052"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert compute[kind]["grpc"]["port"] == 50052
    assert compute["readinessProbe"]["grpc"]["service"] == "pagedserve.compute.v1.Compute"
    startup = compute["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading takes minutes
    # The memory service has only its Unix socket: the same health check, sent over that socket.
    memory = container(pod, "memory")
    assert memory["livenessProbe"]["exec"]["command"][-1] == "unix:" + flag(memory, "--socket")
    probe_script = mounts(memory)["probe"] + "/health_probe.py"
    assert memory["livenessProbe"]["exec"]["command"][:2] == ["python", probe_script]
    gateway = container(gateway_pod(rendered), "gateway")
    assert flag(gateway, "--listen") == "0.0.0.0:50051"
    assert gateway["readinessProbe"]["grpc"] == {"port": 50051, "service": "pagedserve.gateway.v1.Gateway"}
    # Not SERVING until an engine is ready (minutes): no restart for that, only readiness. Liveness
    # asks both fronts for an answer, any status (a TCP probe passed while the
    # gateway, out of descriptors, answered nothing).
    assert gateway["startupProbe"]["tcpSocket"] == {"port": "grpc"}
    live = gateway["livenessProbe"]["exec"]["command"]
    assert live[:3] == ["python", mounts(gateway)["probe"] + "/health_probe.py", "--alive"]
    assert live[live.index("--http-port") + 1] == "8000"
    assert live[-2:] == ["127.0.0.1:50051", "pagedserve.gateway.v1.Gateway"]
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in gateway["ports"]
    # The OpenAI-compatible HTTP front: its flag, its container port, a port on the Service.
    assert flag(gateway, "--http-port") == "8000"
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in gateway["ports"]
    service_ports = rendered.one("Service", "-gateway")["spec"]["ports"]
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
            "appProtocol": "http"} in service_ports


def test_security_context_everywhere(case) -> None:
    _, _, rendered = case
    for pod in (engine_pod(rendered), gateway_pod(rendered)):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert "privileged" not in sc
            # What the services write lands on a volume, never the read-only root.
            assert mounts(c)["tmp"] == "/tmp" and env(c)["HOME"] == "/tmp", c["name"]
            assert mounts(c)["cache"] == env(c)["PAGEDSERVE_CACHE_DIR"], c["name"]
            assert "resources" in c


def test_gateway_discovers_engines_through_the_headless_service(case) -> None:
    _, values, rendered = case
    service = rendered.one("Service", "-engine")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False  # loading engines get no traffic
    engine = rendered.one("Deployment", "-engine")
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert engine["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    gateway_selector = rendered.one("Service", "-gateway")["spec"]["selector"]
    assert not gateway_selector.items() <= pod_labels.items()  # gateway Service never routes to engines
    backend = flag(container(gateway_pod(rendered), "gateway"), "--backend")
    assert backend == f"dns:{service['metadata']['name']}.{NAMESPACE}.svc:50052"
    assert engine["spec"]["replicas"] == values.get("engine", {}).get("replicas", 1)


def test_notes_tell_how_to_reach_the_gateway(case) -> None:
    _, _, rendered = case
    assert "kubectl -n llm port-forward svc/demo-pagedserve-gateway 50051:50051" in rendered.notes
    assert "grpcurl -plaintext" in rendered.notes
    assert "pagedserve.gateway.v1.Gateway/Generate" in rendered.notes
    assert "port-forward svc/demo-pagedserve-gateway 8000:8000" in rendered.notes
    assert "curl http://localhost:8000/v1/chat/completions" in rendered.notes


def test_gpu_through_one_dra_claim_shared_by_both_containers() -> None:
    rendered = render({"gpu": {"mode": "dra"}})
    template = rendered.one("ResourceClaimTemplate", "-gpu")
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1}
    pod = engine_pod(rendered)
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": template["metadata"]["name"]}]
    for name in ("memory", "compute"):
        c = container(pod, name)
        assert c["resources"]["claims"] == [{"name": "gpu"}]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert flag(container(pod, "memory"), "--device") == "cuda:0"
    assert container(pod, "compute")["image"] == "pagedserve:0.1.0-cuda"
    assert container(gateway_pod(rendered), "gateway")["image"] == "pagedserve:0.1.0-cpu"  # no GPU needed


def test_gpu_through_the_device_plugin() -> None:
    rendered = render({"gpu": {"mode": "device-plugin"}})
    assert "ResourceClaimTemplate" not in rendered.kinds()
    pod = engine_pod(rendered)
    assert "resourceClaims" not in pod
    memory, compute = container(pod, "memory"), container(pod, "compute")
    # The memory service allocates the KV pool: it holds the scheduler's one GPU ...
    assert memory["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert memory["resources"]["limits"]["memory"] == "4Gi"  # the user's limits kept
    # ... and the compute container sees devices through the runtime's environment variable.
    assert "nvidia.com/gpu" not in compute["resources"].get("limits", {})
    assert env(compute)["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_cpu_mode_has_no_gpu_at_all() -> None:
    rendered = render(VALUE_SETS["cpu-download"])
    assert "ResourceClaimTemplate" not in rendered.kinds()
    pod = engine_pod(rendered)
    assert "resourceClaims" not in pod
    for c in pod["containers"] + pod["initContainers"]:
        assert c["image"] == "pagedserve:0.1.0-cpu"
        assert "claims" not in c["resources"]
        assert not [k for k in c["resources"].get("limits", {}) if "gpu" in k]
        assert "NVIDIA_VISIBLE_DEVICES" not in env(c)
    assert flag(container(pod, "memory"), "--device") == "cpu"


def test_model_sources() -> None:
    default = engine_pod(render({}))
    assert flag(container(default, "compute"), "--model") == "default"
    assert [c["name"] for c in default["initContainers"]] == ["memory"]

    pvc = engine_pod(render(VALUE_SETS["gpu-dra-pvc"]))
    compute = container(pvc, "compute")
    assert flag(compute, "--model") == "/models/llama-3b"
    assert mounts(compute)["model"] == "/models"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in compute["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pvc["volumes"]

    download = engine_pod(render(VALUE_SETS["cpu-download"]))
    assert [c["name"] for c in download["initContainers"]] == ["download-model", "memory"]
    init = container(download, "download-model")
    assert "restartPolicy" not in init  # a plain init container: done before the engine starts
    model_dir = flag(container(download, "compute"), "--model")
    assert model_dir == "/var/cache/pagedserve/models/HuggingFaceTB--SmolLM2-360M-Instruct"
    assert init["command"] == ["hf", "download", "HuggingFaceTB/SmolLM2-360M-Instruct"]
    assert flag(init, "--local-dir") == model_dir
    assert mounts(init)["cache"] == mounts(container(download, "compute"))["cache"]
    [token] = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}


def test_optional_objects_follow_values() -> None:
    plain = render({})
    assert sorted(plain.kinds()) == [
        "ConfigMap", "Deployment", "Deployment", "NetworkPolicy", "NetworkPolicy", "ResourceClaimTemplate", "Secret",
        "Secret", "Service", "Service", "Service"]
    assert container(gateway_pod(plain), "gateway")["args"].count("--api-keys-file") == 0

    full = render(VALUE_SETS["multi-replica"])
    hpa = full.one("HorizontalPodAutoscaler", "-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == full.one("Deployment", "-gateway")["metadata"]["name"]
    assert "replicas" not in full.one("Deployment", "-gateway")["spec"]  # the autoscaler owns it
    pdb = full.one("PodDisruptionBudget", "-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        full.one("Deployment", "-gateway")["spec"]["template"]["metadata"]["labels"].items()
    monitors = {m["metadata"]["name"]: m for m in full.objects if m["kind"] == "ServiceMonitor"}
    assert {n: [e["port"] for e in m["spec"]["endpoints"]] for n, m in monitors.items()} == {
        "demo-pagedserve-gateway": ["metrics"],
        "demo-pagedserve-engine": ["compute-metrics", "memory-metrics"],
    }
    assert all(m["metadata"]["labels"]["release"] == "prometheus" for m in monitors.values())
    gateway = container(gateway_pod(full), "gateway")
    assert flag(gateway, "--api-keys-file") == "/etc/pagedserve/api-keys/api-keys"
    assert mounts(gateway)["api-keys"] == "/etc/pagedserve/api-keys"


def test_every_metrics_server_listens_on_the_pod_ip(case) -> None:
    """The services bind metrics to 127.0.0.1 by default; the ServiceMonitor scrapes the pod IP."""
    _, _, rendered = case
    pod = engine_pod(rendered)
    for name in ("memory", "compute"):
        assert flag(container(pod, name), "--metrics-host") == "0.0.0.0"
    assert flag(container(gateway_pod(rendered), "gateway"), "--metrics-host") == "0.0.0.0"


def test_metrics_have_their_own_service_never_the_public_one() -> None:
    """With type LoadBalancer the public Service used to publish the metrics port."""
    rendered = render({"gateway": {"service": {"type": "LoadBalancer"}}})
    public = rendered.one("Service", "-gateway")
    assert public["spec"]["type"] == "LoadBalancer"
    assert [p["name"] for p in public["spec"]["ports"]] == ["grpc", "http"]  # both public APIs, no metrics
    metrics = rendered.one("Service", "-gateway-metrics")
    assert metrics["spec"]["type"] == "ClusterIP"
    assert metrics["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert metrics["spec"]["selector"] == public["spec"]["selector"]
    gateway = container(gateway_pod(rendered), "gateway")
    assert flag(gateway, "--write-stall-timeout-s") == "30" and "--tls-cert" not in gateway["args"]
    assert flag(gateway, "--tool-call-parser") == "auto"


def test_gateway_tool_call_parser_is_passed() -> None:
    """The chart chooses the tool-call format as `pagedserve up --tool-call-parser` does."""
    gateway = container(gateway_pod(render({"gateway": {"toolCallParser": "llama3_json"}})), "gateway")
    assert flag(gateway, "--tool-call-parser") == "llama3_json"


def test_gateway_tls_from_an_existing_secret_or_from_values() -> None:
    """The certificate is mounted, passed as flags, and readiness is checked over TLS."""
    existing = render({"gateway": {"tls": {"enabled": True, "secretName": "gw-cert", "serverName": "llm.example.com"}}})
    pod = gateway_pod(existing)
    gateway = container(pod, "gateway")
    assert flag(gateway, "--tls-cert") == "/etc/pagedserve/tls/tls.crt"
    assert flag(gateway, "--tls-key") == "/etc/pagedserve/tls/tls.key"
    assert mounts(gateway)["tls"] == "/etc/pagedserve/tls"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "gw-cert"
    assert volumes["probe"]["configMap"]["name"] == "demo-pagedserve-engine-probe"
    command = gateway["readinessProbe"]["exec"]["command"]
    assert command[-2:] == ["127.0.0.1:50051", "pagedserve.gateway.v1.Gateway"]
    assert command[command.index("--tls-server-name") + 1] == "llm.example.com"
    live = gateway["livenessProbe"]["exec"]["command"]  # the liveness probe's TLS, the same way
    assert live[live.index("--tls-server-name") + 1] == "llm.example.com" and "--tls-ca" in live
    assert not [o for o in existing.objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-tls")]

    inline = render({"gateway": {"tls": {"enabled": True, "certificate": "CERT PEM", "privateKey": "KEY PEM",
                                         "serverName": "llm.example.com"}}})
    secret = inline.one("Secret", "-gateway-tls")
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key"}
    volumes = {v["name"]: v for v in gateway_pod(inline)["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "demo-pagedserve-gateway-tls"


def test_engine_accepts_only_its_gateways(case) -> None:
    """A Secret with a random token, mounted in compute and gateway (and nowhere else), the flags that
    read it, and a NetworkPolicy: the compute port from gateway pods only, metrics from the scraper."""
    _, _, rendered = case
    secret = rendered.one("Secret", "-engine-token")
    token = base64.b64decode(secret["data"]["token"])
    assert len(token) == 48 and token.isalnum()
    engine, gateway = engine_pod(rendered), gateway_pod(rendered)
    compute, memory, gw = container(engine, "compute"), container(engine, "memory"), container(gateway, "gateway")
    token_file = "/etc/pagedserve/service-token/token"
    assert flag(compute, "--auth-token-file") == flag(gw, "--backend-token-file") == token_file
    assert mounts(compute)["service-token"] == mounts(gw)["service-token"] == "/etc/pagedserve/service-token"
    assert "service-token" not in mounts(memory)  # the memory service has no TCP port: no token
    for pod in (engine, gateway):
        [volume] = [v for v in pod["volumes"] if v["name"] == "service-token"]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert volume["secret"]["defaultMode"] == 0o440  # the pod's group (fsGroup) only
    policy = rendered.one("NetworkPolicy", "-engine")["spec"]
    engine_labels = rendered.one("Deployment", "-engine")["spec"]["template"]["metadata"]["labels"]
    gateway_labels = rendered.one("Deployment", "-gateway")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= engine_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = policy["ingress"]
    [peer] = grpc_rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace's gateway pods, nothing else
    assert peer["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    assert not peer["podSelector"]["matchLabels"].items() <= engine_labels.items()
    assert grpc_rule["ports"] == [{"port": 50052, "protocol": "TCP"}]
    assert metrics_rule["from"] == [{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert [p["port"] for p in metrics_rule["ports"]] == [9091, 9092]
    assert all(rule.get("from") for rule in policy["ingress"])  # no rule that admits everyone


def test_memory_service_token_is_the_engine_pods_own(case) -> None:
    """A second Secret, mounted in both engine containers and not in the gateway: the memory
    service requires it, the compute service presents it."""
    _, _, rendered = case
    secret = rendered.one("Secret", "-engine-memory-token")
    token = base64.b64decode(secret["data"]["token"])
    assert len(token) == 48 and token.isalnum()
    assert secret["data"]["token"] != rendered.one("Secret", "-engine-token")["data"]["token"]
    engine, gateway = engine_pod(rendered), gateway_pod(rendered)
    compute, memory = container(engine, "compute"), container(engine, "memory")
    token_file = "/etc/pagedserve/memory-token/token"
    assert flag(memory, "--auth-token-file") == flag(compute, "--memory-token-file") == token_file
    assert mounts(memory)["memory-token"] == mounts(compute)["memory-token"] == "/etc/pagedserve/memory-token"
    assert "memory-token" not in mounts(container(gateway, "gateway"))
    [volume] = [v for v in engine["volumes"] if v["name"] == "memory-token"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert volume["secret"]["defaultMode"] == 0o440
    assert not [v for v in gateway["volumes"] if v["name"] == "memory-token"]


def test_engine_auth_with_an_existing_secret_and_no_policy() -> None:
    rendered = render({"engine": {"auth": {"existingSecret": "my-token", "key": "t"},
                                  "memory": {"auth": {"existingSecret": "my-memory-token", "key": "m"}},
                                  "networkPolicy": {"enabled": False}}})
    assert "Secret" not in rendered.kinds()
    assert _policies(rendered) == ["demo-pagedserve-gateway"]
    for pod in (engine_pod(rendered), gateway_pod(rendered)):
        [volume] = [v for v in pod["volumes"] if v["name"] == "service-token"]
        assert volume["secret"]["secretName"] == "my-token"
        assert volume["secret"]["items"] == [{"key": "t", "path": "t"}]
    assert flag(container(engine_pod(rendered), "compute"), "--auth-token-file") == "/etc/pagedserve/service-token/t"
    [volume] = [v for v in engine_pod(rendered)["volumes"] if v["name"] == "memory-token"]
    assert volume["secret"]["secretName"] == "my-memory-token"
    assert volume["secret"]["items"] == [{"key": "m", "path": "m"}]
    assert flag(container(engine_pod(rendered), "memory"), "--auth-token-file") == "/etc/pagedserve/memory-token/m"


def _policies(rendered) -> list[str]:
    return [p["metadata"]["name"] for p in rendered.objects if p["kind"] == "NetworkPolicy"]


def test_gateway_metrics_only_from_the_scraper(case) -> None:
    """The gateway's metrics listen on the pod IP; a NetworkPolicy on gateway pods
    admits the public ports from anyone (or apiFrom) and the metrics port from the scraper only."""
    _, _, rendered = case
    policy = rendered.one("NetworkPolicy", "-gateway")["spec"]
    gateway_labels = rendered.one("Deployment", "-gateway")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    api_rule, metrics_rule = policy["ingress"]
    assert api_rule == {"ports": [{"port": 50051, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"}]}
    assert metrics_rule["from"] == [{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert metrics_rule["ports"] == [{"port": 9090, "protocol": "TCP"}]
    probe = container(gateway_pod(rendered), "gateway")["livenessProbe"]["exec"]["command"]
    assert "--tls-ca" not in probe  # plaintext unless gateway.tls is on (test_gateway_tls_...)


def test_gateway_policy_values() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}]
    rendered = render({"gateway": {"networkPolicy": {"apiFrom": peers, "metricsFrom": []}}})
    [api_rule] = rendered.one("NetworkPolicy", "-gateway")["spec"]["ingress"]  # no metrics rule: nobody scrapes
    assert api_rule["from"] == peers
    rendered = render({"gateway": {"networkPolicy": {"enabled": False}}})
    assert _policies(rendered) == ["demo-pagedserve-engine"]


def test_a_keyless_gateway_answers_its_service_names_only() -> None:
    """Without keys the HTTP front refuses unknown Host names; the chart lists the
    Service's names (and gateway.httpAllowedHosts); with keys, only the latter."""
    def hosts(values: dict) -> list[str]:
        args = container(gateway_pod(render(values)), "gateway")["args"]
        return [args[i + 1] for i, a in enumerate(args) if a == "--http-allowed-hosts"]

    service = "demo-pagedserve-gateway"
    assert hosts({}) == [service, f"{service}.{NAMESPACE}", f"{service}.{NAMESPACE}.svc",
                         f"{service}.{NAMESPACE}.svc.cluster.local"]
    assert hosts({"gateway": {"httpAllowedHosts": ["llm.example.com"]}})[-1] == "llm.example.com"
    assert hosts({"gateway": {"apiKeys": {"secretName": "keys"}}}) == []
    assert hosts({"gateway": {"apiKeys": {"secretName": "keys"}, "httpAllowedHosts": ["*"]}}) == ["*"]


def test_kv_events_are_off_by_default_and_bound_on_the_pods_ports_when_on() -> None:
    """engine.memory.kvEvents: the memory service's flags (bound on the pod, the topic with the pod's IP
    from the downward API), its ports, and a NetworkPolicy rule admitting only the named peers."""
    memory = container(engine_pod(render()), "memory")
    assert flag(memory, "--kv-events-endpoint") is None and "POD_IP" not in env(memory)
    router = {"podSelector": {"matchLabels": {"app": "epp"}}}
    rendered = render({"engine": {"memory": {"kvEvents": {"enabled": True, "from": [router]}}}})
    memory = container(engine_pod(rendered), "memory")
    assert flag(memory, "--kv-events-endpoint") == "tcp://*:5557"
    assert flag(memory, "--kv-events-replay-endpoint") == "tcp://*:5558"
    assert flag(memory, "--kv-events-topic") == "kv@$(POD_IP)@pagedserve"  # Kubernetes expands $(POD_IP)
    [pod_ip] = [e for e in memory["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {p["name"]: p["containerPort"] for p in memory["ports"]} == {
        "memory-metrics": 9092, "kv-events": 5557, "kv-events-replay": 5558}
    for obj in rendered.objects:
        if obj["kind"] in ("Deployment", "NetworkPolicy"):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    events_rule = rendered.one("NetworkPolicy", "-engine")["spec"]["ingress"][-1]
    assert events_rule == {"from": [router], "ports": [{"port": 5557, "protocol": "TCP"},
                                                       {"port": 5558, "protocol": "TCP"}]}
    # No replay socket: no flag, no port.
    rendered = render({"engine": {"memory": {"kvEvents": {"enabled": True, "replayPort": None}}}})
    memory = container(engine_pod(rendered), "memory")
    assert flag(memory, "--kv-events-replay-endpoint") is None
    assert [p["name"] for p in memory["ports"]] == ["memory-metrics", "kv-events"]


def test_kv_tier_is_off_by_default() -> None:
    pod = engine_pod(render({}))
    memory = container(pod, "memory")
    assert flag(memory, "--kv-disk-dir") is None and flag(memory, "--kv-disk-bytes") is None
    assert "kv-tier" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize("claim", ["", "kv-tier"])
def test_kv_tier_volume_is_mounted_into_the_memory_service_and_passed_as_flags(claim: str) -> None:
    """The disk tier's directory is a private subdirectory of its own volume (an emptyDir
    of sizeLimit, or an existing claim), in the memory container only, and its budget the flag's."""
    tier = {"enabled": True, "existingClaim": claim, "bytes": 4 << 30, "sizeLimit": "5Gi",
            "mountPath": "/var/lib/kv"}
    pod = engine_pod(render({"engine": {"memory": {"kvTier": tier}}}))
    memory, compute = container(pod, "memory"), container(pod, "compute")
    assert flag(memory, "--kv-disk-dir") == "/var/lib/kv/tier"
    assert flag(memory, "--kv-disk-bytes") == str(4 << 30)
    assert mounts(memory)["kv-tier"] == "/var/lib/kv"
    assert "kv-tier" not in mounts(compute)  # the compute service reads tier blocks through the pool
    [volume] = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
    if claim:
        assert volume == {"name": "kv-tier", "persistentVolumeClaim": {"claimName": claim}}
    else:
        assert volume == {"name": "kv-tier", "emptyDir": {"sizeLimit": "5Gi"}}


def test_kv_tier_values_that_cannot_work_fail_at_install() -> None:
    # A budget beyond the emptyDir would get the pod evicted when the tier fills.
    with pytest.raises(helm.HelmRenderError) as info:
        render({"engine": {"memory": {"kvTier": {"enabled": True, "bytes": 30 << 30, "sizeLimit": "20Gi"}}}})
    assert "engine.memory.kvTier.bytes (32212254720) must be at most its emptyDir's sizeLimit (20Gi)" in str(info.value)
    # One claim under several replicas: several memory services on one tier directory.
    with pytest.raises(helm.HelmRenderError) as info:
        render({"engine": {"replicas": 2, "memory": {"kvTier": {"enabled": True, "existingClaim": "kv"}}}})
    assert "engine.memory.kvTier.existingClaim serves one engine replica" in str(info.value)
    # Disabled, nothing about the tier is checked; the emptyDir is per pod, so replicas are fine.
    render({"engine": {"replicas": 2, "memory": {"kvTier": {"enabled": False, "existingClaim": "kv"}}}})
    render({"engine": {"replicas": 2, "memory": {"kvTier": {"enabled": True}}}})


def test_kv_host_tier_is_passed_with_or_without_the_disk_tier() -> None:
    """engine.memory.kvTier.hostBytes is the memory service's --kv-host-bytes, alone or in
    front of the disk tier; off (null) by default; at or beyond the container's memory limit it fails."""
    assert flag(container(engine_pod(render({})), "memory"), "--kv-host-bytes") is None
    alone = container(engine_pod(render({"engine": {"memory": {"kvTier": {"hostBytes": 1 << 30}}}})), "memory")
    assert flag(alone, "--kv-host-bytes") == str(1 << 30) and flag(alone, "--kv-disk-dir") is None
    both = container(engine_pod(render({"engine": {"memory": {"kvTier": {"enabled": True, "hostBytes": 2 << 30}}}})),
                     "memory")
    assert (flag(both, "--kv-host-bytes"), flag(both, "--kv-disk-bytes")) == (str(2 << 30), str(10 << 30))
    with pytest.raises(helm.HelmRenderError) as info:
        render({"engine": {"memory": {"kvTier": {"hostBytes": 4 << 30}}}})  # the default limit is 4Gi
    assert "engine.memory.kvTier.hostBytes (4294967296) must be below the memory container's memory limit" \
        in str(info.value)


def test_kv_host_tier_and_a_cpu_pool_must_fit_the_memory_limit_together() -> None:
    """On CPU the KV pool is in /dev/shm, pages the memory service writes first (its container's
    memory), beside the host tier: 3 GiB of host tier and the 1 GiB pool reach the 4 GiB limit."""
    cpu = {"gpu": {"mode": "none"}}
    with pytest.raises(helm.HelmRenderError) as info:
        render({**cpu, "engine": {"memory": {"kvTier": {"hostBytes": 3 << 30}}}})
    assert ("engine.memory.kvTier.hostBytes (3221225472) plus the KV pool it keeps in /dev/shm on CPU "
            "(engine.memory.kvCacheBytes, 1073741824) must be below") in str(info.value)
    ok = container(engine_pod(render({**cpu, "engine": {"memory": {"kvTier": {"hostBytes": 2 << 30}}}})), "memory")
    assert flag(ok, "--kv-host-bytes") == str(2 << 30)
    # On a GPU the pool is device memory: the host tier alone counts.
    render({"engine": {"memory": {"kvTier": {"hostBytes": 3 << 30}}}})
