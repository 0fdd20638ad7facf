"""The memory service's identity (memory_service/identity.py): fresh per start, or kept in a tier directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from structlog.testing import capture_logs

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


def test_a_full_disk_leaves_the_id_unkept_instead_of_failing_the_start(tmp_path: Path) -> None:
    """Seen with the tier on a full tmpfs: the id's write failed with ENOSPC and the memory service
    exited with a traceback before serving. /dev/full gives the same ENOSPC without a mount: the
    temporary file's name points there."""
    (tmp_path / f".{ID_FILE_NAME}.{os.getpid()}.tmp").symlink_to("/dev/full")
    with capture_logs() as events:
        first = service_id(tmp_path)
    assert first.startswith("ms-") and [e["event"] for e in events] == ["memory_service_id_not_kept"]
    assert events[0]["error"] == "No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing kept, nothing left behind
    assert service_id(tmp_path) != first  # the disk has room again: a new id, kept from now on
    assert (tmp_path / ID_FILE_NAME).exists()


def test_tier_info_is_validated() -> None:
    assert KvTierInfo("disk", 1 << 30).capacity_bytes == 1 << 30
    with pytest.raises(ValueError, match="kind"):
        KvTierInfo("tape", 1)
    with pytest.raises(ValueError, match="capacity_bytes"):
        KvTierInfo("host", 0)
