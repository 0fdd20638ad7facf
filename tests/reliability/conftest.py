"""One stack (memory + compute + gateway, the tiny byte-tokenizer model) shared by the whole
reliability suite: starting processes is what costs time on a 2-core machine. Tests that kill or
stop a process put the stack back the way they found it (restarted, serving, every block free)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve_testing.stack import Stack, StackConfig, start_stack
from pagedserve_testing.tiny_model import ServiceModel

# Requests the session gateway holds at once: the overload test sends more than this.
GATEWAY_MAX_QUEUED = 32


@pytest.fixture(scope="session")
def stack(service_model: ServiceModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir: Path = tmp_path_factory.mktemp("rel-run")
    started = start_stack(StackConfig(str(service_model.path), gateway_max_queued=GATEWAY_MAX_QUEUED), run_dir)
    yield started
    statuses = started.stop()
    assert statuses == {"gateway": 0, "compute": 0, "memory": 0}, statuses
