"""Run a rendered pod's containers as local processes, the way the kubelet would run them.

Each container keeps its rendered command, args and environment; what a cluster provides is mapped
onto this machine:
  - every volume becomes a directory under one root, shared by the containers of a pod exactly
    where their volumeMounts share it (a ConfigMap volume is filled with the rendered ConfigMap's
    data; a named volume can be pointed at an existing directory, e.g. a model);
  - `/dev/shm` stays `/dev/shm`: POSIX shared memory has no other place, and the pod's emptyDir of
    medium Memory is exactly that;
  - the pod IP (0.0.0.0 listeners) becomes 127.0.0.1 and cluster DNS names become names given by
    the test (the engine's headless Service -> localhost).
Paths are rewritten only where an argument or variable starts with a mount path (optionally after
`unix:`), so anything the chart did not mount stays as rendered.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from pagedserve.process import ServiceProcess, check_health
from pagedserve.stack import HEALTH_SERVICES, ready


@dataclass
class LocalPod:
    """One pod's volumes on this machine. `overrides` maps volume names to existing directories."""

    name: str
    spec: dict[str, Any]
    root: Path
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> base64 data, as rendered
    overrides: dict[str, Path] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.volume_dirs: dict[str, Path] = {}
        for volume in self.spec["volumes"]:
            name = volume["name"]
            if name in self.overrides:
                path = self.overrides[name]
            elif volume.get("emptyDir", {}).get("medium") == "Memory":
                path = Path("/dev/shm")
            else:
                path = self.root / self.name / name
                path.mkdir(parents=True, exist_ok=True)
                if "emptyDir" in volume:
                    path.chmod(0o777)  # as the kubelet makes an emptyDir: world-writable
                if "configMap" in volume:
                    for key, text in self.config_maps[volume["configMap"]["name"]].items():
                        (path / key).write_text(text)
                if "secret" in volume:  # the rendered Secret's keys as files, with the volume's mode
                    spec = volume["secret"]
                    data = self.secrets[spec["secretName"]]
                    for item in spec.get("items") or [{"key": k, "path": k} for k in data]:
                        (path / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
                        (path / item["path"]).chmod(spec.get("defaultMode", 0o644))
            self.volume_dirs[name] = path

    def container(self, name: str) -> dict[str, Any]:
        [found] = [c for c in self.spec["containers"] + self.spec.get("initContainers", []) if c["name"] == name]
        return found

    def local_path(self, container: dict[str, Any], value: str) -> str:
        """`value` with its leading mount path (if any) replaced by that volume's local directory."""
        scheme = "unix:" if value.startswith("unix:") else ""
        path = value[len(scheme):]
        best = ""
        for mount in container.get("volumeMounts", []):
            mount_path = mount["mountPath"].rstrip("/")
            if (path == mount_path or path.startswith(mount_path + "/")) and len(mount_path) > len(best):
                best, local = mount_path, self.volume_dirs[mount["name"]]
        return scheme + (str(local) + path[len(best):] if best else path)

    def local_value(self, container: dict[str, Any], value: str) -> str:
        """A rendered argument or variable as it must read on this machine."""
        if value.startswith("0.0.0.0:"):
            return "127.0.0.1:" + value.split(":", 1)[1]
        if value == "0.0.0.0":
            return "127.0.0.1"
        if value.startswith("dns:"):
            host, port = value[len("dns:"):].rsplit(":", 1)
            return f"dns:{self.hosts.get(host, host)}:{port}"
        return self.local_path(container, value)

    def argv(self, name: str) -> list[str]:
        c = self.container(name)
        return [self.local_value(c, a) for a in c.get("command", []) + c.get("args", [])]

    def env(self, name: str) -> dict[str, str]:
        """This process's environment (PATH, PYTHONPATH) with the container's variables on top."""
        c = self.container(name)
        env = dict(os.environ)
        for var in c.get("env", []):
            assert "value" in var or "valueFrom" in var, var
            if "value" in var:
                env[var["name"]] = self.local_value(c, var["value"])
        return env

    def start(self, name: str, address: str, *, log_dir: Path, ready_timeout_s: float = 120.0) -> ServiceProcess:
        """Start container `name` (a `python -m MODULE ...` command) and wait until `address` reports
        the module's own health service (pagedserve.stack) SERVING."""
        argv = self.argv(name)
        assert argv[:2] == ["python", "-m"], f"{name}: expected `python -m MODULE`, got {argv[:3]}"
        module = argv[2]
        return ready(ServiceProcess(module, argv[3:], address=address, health_service=HEALTH_SERVICES[module],
                                    env=self.env(name), log_file=log_dir / f"{self.name}-{name}.log"), ready_timeout_s)

    def probe(self, container_name: str, kind: str) -> bool:
        """Run one declared probe (startupProbe, readinessProbe, livenessProbe) once, as the kubelet would."""
        c = self.container(container_name)
        probe = c[kind]
        timeout_s = float(probe.get("timeoutSeconds", 1))
        if "grpc" in probe:
            address = f"127.0.0.1:{probe['grpc']['port']}"
            status = check_health(address, probe["grpc"].get("service", ""), timeout_s=timeout_s)
            return status == health_pb2.HealthCheckResponse.SERVING
        if "tcpSocket" in probe:
            port = probe["tcpSocket"]["port"]
            if isinstance(port, str):  # a named container port
                [port] = [p["containerPort"] for p in c["ports"] if p["name"] == port]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=timeout_s).close()
                return True
            except OSError:
                return False
        if "exec" in probe:
            argv = [self.local_value(c, a) for a in probe["exec"]["command"]]
            if argv[0] == "python":  # the image's python is this environment's
                argv[0] = sys.executable
            done = subprocess.run(argv, env=self.env(container_name), capture_output=True, timeout=timeout_s + 10)
            return done.returncode == 0
        raise AssertionError(f"unknown probe handler in {probe}")
