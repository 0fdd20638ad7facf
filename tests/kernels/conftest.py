"""Test setup for the kernels package.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. TRITON_INTERPRET
must be set before the kernel modules are imported (`triton.jit` reads it when decorating), so it
is set here, at conftest import, ahead of every test module of this directory. With a GPU it is
left alone and the same tests run the compiled kernels on CUDA tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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
