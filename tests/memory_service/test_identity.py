"""The memory service's identity (memory_service/identity.py): fresh per start, or kept in a tier directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from memory_service.identity import ID_FILE_NAME, KvTierInfo, service_id


def test_without_a_directory_every_start_is_a_new_service() -> None:
    first, second = service_id(None), service_id(None)
    assert first != second
    assert first.startswith("ms-") and len(first) == 35


def test_a_directory_keeps_the_id_across_restarts(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    first = service_id(directory)
    assert service_id(directory) == first  # a restart on the same directory is the same cache
    assert service_id(tmp_path / "other") != first
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory / ID_FILE_NAME).st_mode) == 0o600
    assert sorted(p.name for p in directory.iterdir()) == [ID_FILE_NAME]  # no temporary left behind


@pytest.mark.parametrize("content", ["", "ms-123\n", "ms-" + "G" * 32, "\x00" * 40])
def test_a_torn_or_edited_id_file_is_replaced(tmp_path: Path, content: str) -> None:
    (tmp_path / ID_FILE_NAME).write_text(content)
    fresh = service_id(tmp_path)
    assert fresh.startswith("ms-") and fresh != content.strip()
    assert service_id(tmp_path) == fresh


def test_tier_info_is_validated() -> None:
    assert KvTierInfo("disk", 1 << 30).capacity_bytes == 1 << 30
    with pytest.raises(ValueError, match="kind"):
        KvTierInfo("tape", 1)
    with pytest.raises(ValueError, match="capacity_bytes"):
        KvTierInfo("host", 0)
