"""What the tests check about processes: gone (exited, or a zombie waiting to be reaped)."""

from __future__ import annotations

import os
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
