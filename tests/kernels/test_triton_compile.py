"""The Triton kernels build for sm_90 (H100/H200) on a machine without a GPU.

The interpreter never compiles, so this is what catches, on CPU, kernel code that does not lower
to PTX, and launcher default tiles that make ptxas spill registers to local memory (a large
slowdown for a memory-bound kernel). The build runs in a fresh process (see sm90_build.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import triton

HERE = Path(__file__).resolve().parent
HAS_PTXAS = (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()
pytestmark = pytest.mark.skipif(not HAS_PTXAS, reason="this Triton ships no ptxas")


@pytest.fixture(scope="module")
def builds() -> dict[str, dict]:
    result = subprocess.run([sys.executable, str(HERE / "sm90_build.py")], cwd=HERE.parents[1],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["bf16-decode", "bf16-prefill", "bf16-decode-split", "fp32-prefill"])
def test_attention_builds_without_spills(builds: dict[str, dict], case: str) -> None:
    usage = builds[case]
    assert usage["STACK"] == 0 and usage.get("LOCAL", 0) == 0, f"register spills: {usage}"
    assert usage["vector_loads"], "K/V loads are not vectorised"
    if case.startswith("bf16"):
        assert usage["mma"], "no tensor-core MMA in the bf16 build"


@pytest.mark.parametrize("case", ["merge", "write_kv"])
def test_helper_kernels_build_without_spills(builds: dict[str, dict], case: str) -> None:
    assert builds[case]["STACK"] == 0
