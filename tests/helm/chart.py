"""Render the pagedserve chart with the real Helm library (helm-python-sdk carries Helm's Go SDK).

Rendering goes through the same path as `helm install`: values are coalesced with the chart's
defaults and checked against values.schema.json, then the templates run. No cluster is involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "pagedserve"
RELEASE = "demo"
NAMESPACE = "llm"


@dataclass(frozen=True)
class Rendered:
    """One rendering: every Kubernetes object (in template order) and the NOTES.txt text."""

    objects: list[dict[str, Any]]
    notes: str

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        """The single object of `kind` whose name ends with `name_suffix`; fails if not exactly one."""
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
        return found[0]

    def kinds(self) -> list[str]:
        return [o["kind"] for o in self.objects]


def render(values: dict[str, Any] | None = None) -> Rendered:
    """Render the chart as release `demo` in namespace `llm` (raises HelmError on bad values)."""
    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    notes = ""
    for path in sorted(manifests):
        if path.endswith("NOTES.txt"):
            notes = manifests[path]
            continue
        objects += [doc for doc in yaml.safe_load_all(manifests[path]) if doc]
    return Rendered(objects=objects, notes=notes)


def lint(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`helm lint --strict` findings of warning level or worse (an empty list means clean)."""
    report = helm.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)
    return [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]


def engine_pod(rendered: Rendered) -> dict[str, Any]:
    return rendered.one("Deployment", "-engine")["spec"]["template"]["spec"]


def gateway_pod(rendered: Rendered) -> dict[str, Any]:
    return rendered.one("Deployment", "-gateway")["spec"]["template"]["spec"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
    return found


def flag(c: dict[str, Any], name: str) -> str | None:
    """The value after `name` in a container's args (None when absent)."""
    args = c["args"]
    return args[args.index(name) + 1] if name in args else None


def mounts(c: dict[str, Any]) -> dict[str, str]:
    """volume name -> mount path of one container."""
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}
