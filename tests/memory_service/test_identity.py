"""The memory service's identity (memory_service/identity.py): fresh per start, or kept in a tier directory."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from memory_service import identity
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


def test_a_full_disk_leaves_the_id_unkept_instead_of_failing_the_start(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen with the tier on a full tmpfs: the id's write failed with ENOSPC and the memory service
    exited with a traceback before serving. The write fails so here without a mount. (A symlink from
    the temporary file's name to /dev/full did it before; such a link is no longer followed.)"""
    def full_disk(fd: int, *args: object, **kwargs: object) -> None:
        os.close(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(identity.os, "fdopen", full_disk)
    with capture_logs() as events:
        first = service_id(tmp_path)
    monkeypatch.undo()
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


@pytest.mark.parametrize("plant", ["symlink_to_dev_zero", "fifo", "hard_link"])
def test_a_planted_id_file_is_replaced_not_followed(tmp_path: Path, plant: str) -> None:
    """A symlink to /dev/zero read to a MemoryError, a FIFO hung the start, and a
    planted symlink under the temporary file's name had its target overwritten. Each is now a fresh
    id, at once, and nothing outside the directory is written."""
    kept = service_id(tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_text(kept + "\n")
    id_file = tmp_path / ID_FILE_NAME
    id_file.unlink()
    if plant == "symlink_to_dev_zero":
        id_file.symlink_to("/dev/zero")
    elif plant == "fifo":
        os.mkfifo(id_file, 0o600)
    else:
        os.link(outside, id_file)  # a well-formed id, but a file linked from elsewhere
    (tmp_path / f".{ID_FILE_NAME}.{os.getpid()}.tmp").symlink_to(outside)  # the temp name, planted
    fresh = service_id(tmp_path)
    assert fresh != kept and id_file.read_text().strip() == fresh
    assert stat.S_ISREG(os.lstat(id_file).st_mode) and os.lstat(id_file).st_nlink == 1
    assert outside.read_text() == kept + "\n"  # the link's target untouched
