"""A build lock left by a killed kernel build must not make every later start wait forever."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from pagedserve_kernels import cpu_ops


def test_a_stale_build_lock_is_cleared(tmp_path):
    built = cpu_ops.build_dir()
    if not (built / f"{cpu_ops._NAME}.so").is_file():
        pytest.skip("the fused CPU kernels are not built on this machine")
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    # The same build under a fresh cache root (up to date, so nothing compiles), plus torch's lock file
    # as a build killed midway leaves it.
    probe = "from pagedserve_kernels import cpu_ops; print(cpu_ops.build_dir())"
    directory = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                               check=True).stdout.strip()
    shutil.copytree(built, directory)
    (tmp_path / "cpu_ops" / os.path.basename(directory) / "lock").touch()
    load = "from pagedserve_kernels import cpu_ops; ops = cpu_ops.load(); print(ops is not None, cpu_ops.origin())"
    # Before the fix torch waited on the lock file for ever: the timeout fails the test.
    done = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("True built for this machine"), done.stdout + done.stderr[-2000:]
    assert not (tmp_path / "cpu_ops" / os.path.basename(directory) / "lock").exists()


def test_a_build_from_another_checkout_is_loaded_without_compiling(tmp_path):
    """The build directory's key names the source's digest, not its path; torch's builder names the
    path in build.ninja, so every checkout at another path (a fresh clone, a worktree) compiled the
    same source again. Before: rebuilt (the library replaced, a minute of CPU or more)."""
    built = cpu_ops.build_dir()
    if not (built / f"{cpu_ops._NAME}.so").is_file():
        pytest.skip("the fused CPU kernels are not built on this machine")
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    probe = "from pagedserve_kernels import cpu_ops; print(cpu_ops.build_dir())"
    directory = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                               check=True).stdout.strip()
    shutil.copytree(built, directory)
    ninja = os.path.join(directory, "build.ninja")
    with open(ninja) as f:
        text = f.read()
    with open(ninja, "w") as f:  # as another checkout left it
        f.write(re.sub(r"compile \S+/cpu_ops\.cpp", "compile /elsewhere/kernels/csrc/cpu_ops.cpp", text))
    library = os.path.join(directory, f"{cpu_ops._NAME}.so")
    before = os.stat(library).st_mtime_ns
    load = "from pagedserve_kernels import cpu_ops; ops = cpu_ops.load(); print(ops is not None, cpu_ops.origin())"
    done = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("True built for this machine"), done.stdout + done.stderr[-2000:]
    assert os.stat(library).st_mtime_ns == before
    with open(ninja) as f:
        assert "/elsewhere/kernels/csrc" in f.read()  # the builder never ran
