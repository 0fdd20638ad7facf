"""Run a rendered pod's containers in Docker, the way the kubelet would run them.

A pod becomes a sandbox container (as Kubernetes' pause container) that owns what the pod's
containers share: the network namespace (one IP, the pod's ports published to this machine), the IPC
namespace with a /dev/shm of the `medium: Memory` emptyDir's size, the process namespace (with
shareProcessNamespace) and the pod's emptyDirs (anonymous volumes, removed with the sandbox). Each
container then runs its rendered command, args and environment from the image, with its
securityContext, memory limit and volumes mapped onto `docker run` flags; a mapping this module does
not know fails the test rather than being dropped. Everything carries one label, so a test can
check that nothing is left behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from pagedserve.process import check_health, wait_until

LABEL = "pagedserve.test"
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} ...: {done.stderr.strip()}")
    return done


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes quantity ("2Gi", "512Mi", 1073741824) in bytes."""
    text = str(quantity)
    for suffix, factor in _UNITS.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def security_flags(pod_context: dict[str, Any], context: dict[str, Any]) -> list[str]:
    """`docker run` flags for a pod's and a container's securityContext (every key is mapped or refused)."""
    merged = {**pod_context, **context}
    flags: list[str] = []
    for key, value in merged.items():
        if key == "runAsNonRoot":
            assert value is True and merged.get("runAsUser", 0) != 0, merged
        elif key == "runAsUser":
            flags += ["--user", f"{value}:{merged.get('runAsGroup', value)}"]
        elif key == "fsGroup":  # the kubelet adds it to every process's groups
            flags += ["--group-add", str(value)]
        elif key == "seccompProfile":  # Docker's default profile is the runtime's default
            assert value == {"type": "RuntimeDefault"}, value
        elif key == "allowPrivilegeEscalation":
            flags += [] if value else ["--security-opt", "no-new-privileges"]
        elif key == "readOnlyRootFilesystem":
            flags += ["--read-only"] if value else []
        elif key == "capabilities":
            assert set(value) <= {"drop", "add"}, value
            flags += [f for cap in value.get("drop", []) for f in ("--cap-drop", cap)]
            flags += [f for cap in value.get("add", []) for f in ("--cap-add", cap)]
        elif key != "runAsGroup":
            raise AssertionError(f"securityContext.{key} has no docker mapping here")
    return flags


@dataclass
class DockerPod:
    """One rendered pod (`spec`) run from `image` on Docker network `network`.

    `aliases`: DNS names the pod answers to on the network (its Service's name); `publish`: container
    port -> port on 127.0.0.1 of this machine."""

    name: str
    spec: dict[str, Any]
    image: str
    network: str
    run_label: str
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> key -> decoded value
    aliases: list[str] = field(default_factory=list)
    publish: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefix = f"{self.run_label}-{self.name}"
        self.sandbox = f"{self.prefix}-sandbox"
        self.volumes = {v["name"]: v for v in self.spec["volumes"]}
        self._config_dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))

    def container(self, name: str) -> dict[str, Any]:
        [found] = [c for c in self.spec["containers"] + self.spec.get("initContainers", []) if c["name"] == name]
        return found

    def _shared_mounts(self) -> dict[str, str]:
        """emptyDir name -> mount path, the same in every container (the sandbox holds them)."""
        shared: dict[str, str] = {}
        for c in self.spec["containers"] + self.spec.get("initContainers", []):
            for mount in c.get("volumeMounts", []):
                volume = self.volumes[mount["name"]]
                if "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory":
                    assert shared.setdefault(mount["name"], mount["mountPath"]) == mount["mountPath"], mount
        return shared

    def start_sandbox(self) -> None:
        flags = ["--name", self.sandbox, "--label", f"{LABEL}={self.run_label}", "--rm", "--init",
                 "--network", self.network, "--ipc", "shareable", "--read-only"]
        flags += [f for alias in self.aliases for f in ("--network-alias", alias)]
        flags += [f for port, host in self.publish.items() for f in ("-p", f"127.0.0.1:{host}:{port}")]
        for volume in self.volumes.values():
            if volume.get("emptyDir", {}).get("medium") == "Memory":
                flags += ["--shm-size", str(quantity_bytes(volume["emptyDir"]["sizeLimit"]))]
        flags += [f for path in self._shared_mounts().values() for f in ("-v", path)]
        docker("run", "-d", *flags, "--user", "65534:65534", self.image, "sleep", "infinity")

    def run_flags(self, name: str) -> list[str]:
        """The `docker run` flags of container `name` (after the sandbox is up)."""
        c = self.container(name)
        flags = ["--name", f"{self.prefix}-{name}", "--label", f"{LABEL}={self.run_label}", "--rm",
                 "--network", f"container:{self.sandbox}", "--ipc", f"container:{self.sandbox}",
                 "--volumes-from", self.sandbox]
        if self.spec.get("shareProcessNamespace"):
            flags += ["--pid", f"container:{self.sandbox}"]
        flags += security_flags(self.spec.get("securityContext", {}), c.get("securityContext", {}))
        if "memory" in c.get("resources", {}).get("limits", {}):
            flags += ["--memory", str(quantity_bytes(c["resources"]["limits"]["memory"]))]
        for var in c.get("env", []):
            assert "value" in var, f"{name}: env {var['name']} needs a Secret or field this test has not"
            flags += ["-e", f"{var['name']}={var['value']}"]
        shared = self._shared_mounts()
        for mount in c.get("volumeMounts", []):
            volume = self.volumes[mount["name"]]
            if mount["name"] in shared:
                continue
            if volume.get("emptyDir", {}).get("medium") == "Memory":
                assert mount["mountPath"] == "/dev/shm", mount  # the IPC namespace's /dev/shm
            elif "configMap" in volume:
                directory = self._config_dir / mount["name"]
                directory.mkdir(exist_ok=True)
                for key, text in self.config_maps[volume["configMap"]["name"]].items():
                    (directory / key).write_text(text)
                    (directory / key).chmod(0o644)
                directory.chmod(0o755)
                flags += ["-v", f"{directory}:{mount['mountPath']}:ro"]
            elif "secret" in volume:
                # As the kubelet mounts it: the listed keys, the volume's mode, group-owned by fsGroup.
                source = volume["secret"]
                data = self.secrets[source["secretName"]]
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                directory = self._config_dir / mount["name"]
                directory.mkdir(exist_ok=True)
                group = self.spec.get("securityContext", {}).get("fsGroup", 0)
                for item in items:
                    path = directory / item["path"]
                    path.write_text(data[item["key"]])
                    os.chown(path, 0, group)
                    path.chmod(source.get("defaultMode", 0o644))
                directory.chmod(0o755)
                flags += ["-v", f"{directory}:{mount['mountPath']}:ro"]
            else:
                raise AssertionError(f"{name}: volume {mount['name']} has no docker mapping here: {volume}")
        return flags

    def start(self, name: str) -> None:
        c = self.container(name)
        docker("run", "-d", *self.run_flags(name), self.image, *c.get("command", []), *c.get("args", []))

    def ip(self) -> str:
        return docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                      self.sandbox).stdout.strip()

    def running(self, name: str) -> bool:
        done = docker("inspect", "-f", "{{.State.Running}}", f"{self.prefix}-{name}", check=False)
        return done.stdout.strip() == "true"

    def exec(self, name: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return docker("exec", f"{self.prefix}-{name}", *argv, timeout=timeout, check=False)

    def logs(self, name: str) -> str:
        done = docker("logs", f"{self.prefix}-{name}", check=False)
        return done.stdout + done.stderr

    def probe(self, name: str, kind: str) -> bool:
        """Run one declared probe once, as the kubelet would: gRPC and TCP to the pod's IP, exec inside."""
        c = self.container(name)
        probe = c[kind]
        timeout_s = float(probe.get("timeoutSeconds", 1))
        if "grpc" in probe:
            status = check_health(f"{self.ip()}:{probe['grpc']['port']}", probe["grpc"].get("service", ""),
                                  timeout_s=timeout_s)
            return status == health_pb2.HealthCheckResponse.SERVING
        if "tcpSocket" in probe:
            port = probe["tcpSocket"]["port"]
            if isinstance(port, str):  # a named container port
                [port] = [p["containerPort"] for p in c["ports"] if p["name"] == port]
            try:
                socket.create_connection((self.ip(), port), timeout=timeout_s).close()
                return True
            except OSError:
                return False
        if "exec" in probe:
            return self.exec(name, probe["exec"]["command"], timeout=timeout_s + 10).returncode == 0
        raise AssertionError(f"unknown probe handler in {probe}")

    def shm_entries(self) -> list[str]:
        """What the pod's /dev/shm holds, seen from the sandbox (which outlives the containers)."""
        return docker("exec", self.sandbox, "ls", "-A", "/dev/shm").stdout.split()

    def stop(self, name: str, timeout_s: int) -> int:
        """`docker stop` (SIGTERM, SIGKILL after `timeout_s`); the container's exit status."""
        container = f"{self.prefix}-{name}"
        waiter = subprocess.Popen(["docker", "wait", container], stdout=subprocess.PIPE, text=True)
        docker("stop", "-t", str(timeout_s), container, timeout=timeout_s + 60)
        status = waiter.communicate(timeout=60)[0].strip()
        _wait_removed(container)
        return int(status) if status.lstrip("-").isdigit() else -1

    def stop_sandbox(self) -> None:
        docker("stop", "-t", "10", self.sandbox, check=False, timeout=90)
        _wait_removed(self.sandbox)
        subprocess.run(["rm", "-rf", str(self._config_dir)], check=False)


def _wait_removed(container: str, timeout_s: float = 60) -> None:
    """`--rm` removes a stopped container (and its anonymous volumes) just after `docker stop` returns."""
    wait_until(lambda: docker("container", "inspect", container, check=False).returncode != 0, timeout_s,
               f"{container} removed after its stop", interval_s=0.2)
