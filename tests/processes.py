"""What the tests check about processes: gone (exited, or a zombie waiting to be reaped)."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path


def is_gone(pid: int) -> bool:
    """True once ``pid`` has exited: no such process, or a zombie (state Z), which still answers
    ``kill(pid, 0)`` until its parent (or init) reaps it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ")[-1].startswith("Z")
    except FileNotFoundError:
        return True


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (every thread's children, from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


def open_files_limits(pid: int) -> tuple[int, int]:
    """The (soft, hard) RLIMIT_NOFILE of a running process, read from ``/proc/PID/limits``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no 'Max open files' line in /proc/{pid}/limits")


@contextlib.contextmanager
def lowered_open_files_limit(soft: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE lowered to ``soft`` (for the children it starts meanwhile)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, before[0]), before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
