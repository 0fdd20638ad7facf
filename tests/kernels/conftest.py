"""Test setup for the kernels package.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. `triton.jit` reads
TRITON_INTERPRET when it decorates a function, Triton's own library functions (tl.sum, tl.max, ...)
included, so the variable must be set before triton is first imported. Run alone, this conftest is
early enough. In a whole-suite run other test modules may have imported triton already (importing
a transformers model pulls in torch._dynamo, which imports triton); then the pure-Python triton
modules and our kernel modules are dropped from sys.modules, to be imported afresh in interpreter
mode (the compiled extension triton._C stays, it cannot be loaded twice). Setting the variable in
the top-level tests/conftest.py avoids that step.

With a GPU nothing is changed and the same tests run the compiled kernels on CUDA tensors.
"""

import os
import sys

import pytest
import torch


def _use_triton_interpreter() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = sys.modules.get("triton")
    if triton is None or type(triton.language.sum).__name__ == "InterpretedFunction":
        return
    for name in list(sys.modules):
        is_triton = (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")
        if is_triton or name.startswith("kernels.triton_"):
            del sys.modules[name]


if not torch.cuda.is_available():
    _use_triton_interpreter()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped on CPU)")


@pytest.fixture(autouse=True)
def _skip_cuda_tests_without_gpu(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def triton_device() -> str:
    """Device of the tensors given to the Triton launchers: CPU under the interpreter, else CUDA."""
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
