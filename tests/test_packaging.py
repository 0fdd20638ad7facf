"""What a fresh install gets: import names no other distribution in our dependency tree owns, and a
lock that says the same as pyproject.toml.

transformers 5.25 depends on Hugging Face's `kernels` distribution, imported as `kernels`; ours
was imported by that name too, so `transformers.activations` got ours and every command failed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
# Our import names, one per top-level folder but the kernels' (kernels/pagedserve_kernels).
IMPORT_NAMES = {"pagedserve", "memory_service", "compute_service", "gateway", "pagedserve_kernels",
                "pagedserve_cli", "pagedserve_testing"}

COEXISTENCE = """
import json, sys
import transformers.activations, transformers.models.llama.modeling_llama  # imports `kernels` (5.25 on)
import kernels  # Hugging Face's
import pagedserve_kernels
from compute_service import LLM, SamplingParams, Constraint
print(json.dumps({"hf_kernels": kernels.__file__, "has_get_kernel": hasattr(kernels, "get_kernel"),
                  "ours": pagedserve_kernels.__file__, "step_path": callable(pagedserve_kernels.step_path)}))
"""


def locked() -> dict[str, str]:
    """Package name (canonical) -> pinned version, from requirements/lock.txt."""
    pins = re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", LOCK.read_text(), flags=re.M)
    return {canonicalize_name(name): version for name, version in pins}


def test_transformers_hugging_faces_kernels_and_ours_import_in_one_process() -> None:
    """As `python -m compute_service` runs: from the repository root, the root first on sys.path."""
    if importlib.util.find_spec("kernels") is None:
        pytest.skip("Hugging Face's kernels is not installed (transformers < 5.25 does not need it)")
    result = subprocess.run([sys.executable, "-c", COEXISTENCE], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["has_get_kernel"] and Path(found["hf_kernels"]).parent.parent.name == "site-packages", found
    assert Path(found["ours"]).parent == ROOT / "kernels" / "pagedserve_kernels", found
    assert found["step_path"]


def test_the_kernels_folder_is_no_package() -> None:
    """kernels/ on sys.path (the repository root is, under `python -m` and pytest) must never win
    over an installed `kernels`: without an __init__.py it is at most a namespace portion."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "kernels" / "pagedserve_kernels" / "__init__.py").is_file()


def test_the_wheel_installs_only_our_import_names(tmp_path: Path) -> None:
    """A wheel (what the image and `pip install <git url>` install) writes no top-level name but ours,
    and carries the kernels' C++ source."""
    source = tmp_path / "source"  # a copy: setuptools leaves build/ in the tree it builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("pagedserve", "memory_service", "compute_service", "gateway", "kernels", "pagedserve_cli",
                 "pagedserve_testing"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = tmp_path.glob("pagedserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == IMPORT_NAMES
    assert "pagedserve_kernels/csrc/cpu_ops.cpp" in names


def test_no_import_name_of_ours_is_an_installed_distributions() -> None:
    """Every distribution installed beside us (the lock's whole tree) and the top-level names it
    installs: none is one of ours."""
    ours = metadata.packages_distributions()
    for name in IMPORT_NAMES:
        assert set(ours.get(name, [])) <= {"pagedserve"}, (name, ours.get(name))
    installed = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
    assert not {canonicalize_name(n) for n in IMPORT_NAMES} & (installed - {"pagedserve"})


def _pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


def test_the_lock_pins_every_dependency_within_pyproject_ranges() -> None:
    pins = locked()
    for requirement in _pyproject_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in requirements/lock.txt: run scripts/lock.sh"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
            f"requirements/lock.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}: "
            "run scripts/lock.sh")
    assert pins["torch"] == "2.13.0+cpu"  # the CPU build, never PyPI's multi-GB CUDA one
    assert "setuptools" in pins  # the editable install builds without isolation, from the lock


def test_the_lock_has_no_direct_dependency_pyproject_dropped() -> None:
    """pip-compile notes `# via pagedserve (pyproject.toml)` under each direct dependency."""
    direct = {canonicalize_name(r.name) for r in _pyproject_requirements()}
    blocks = re.split(r"^(?=[A-Za-z0-9._-]+==)", LOCK.read_text(), flags=re.M)
    for block in blocks:
        pin = re.match(r"([A-Za-z0-9._-]+)==", block)
        if pin and "pagedserve (pyproject.toml)" in block and "build-system.requires" not in block:
            assert canonicalize_name(pin.group(1)) in direct, f"{pin.group(1)}: locked, no longer in pyproject.toml"


def test_every_locked_package_is_hashed() -> None:
    blocks = [b for b in re.split(r"^(?=[A-Za-z0-9._-]+==)", LOCK.read_text(), flags=re.M) if "==" in b.split("\n")[0]]
    assert len(blocks) == len(locked()) > 50
    assert all("--hash=sha256:" in block for block in blocks)


def test_the_images_subset_of_the_lock_is_what_the_service_runs_on() -> None:
    """scripts/lock_subset.py: the run-time closure, hashes kept; the test tools stay out of the image."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "lock_subset.py"), "--without", "torch",
                             "--without", "triton"], capture_output=True, text=True, check=True, timeout=60)
    names = {canonicalize_name(n) for n in re.findall(r"^([A-Za-z0-9._-]+)==", result.stdout, flags=re.M)}
    runtime = {canonicalize_name(Requirement(r).name)
               for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert runtime - {"torch", "triton"} <= names
    assert {"sympy", "jinja2", "tokenizers", "kernels"} <= names  # torch's, transformers' own
    assert not names & {"torch", "triton", "pytest", "matplotlib", "openai", "ruff", "hypothesis"}
    assert result.stdout.count("--hash=sha256:") >= len(names)
