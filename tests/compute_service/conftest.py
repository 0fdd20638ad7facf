"""Fixtures shared by the compute service's tests."""

from __future__ import annotations

import pytest

from pagedserve.testing.tiny_model import ServiceModel, build_service_model


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory) -> ServiceModel:
    """The tiny byte-tokenizer Llama of the service tests, built once per session."""
    return build_service_model(tmp_path_factory.mktemp("service-model"))
