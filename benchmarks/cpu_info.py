"""The CPU a benchmark ran on, for its JSON line (a figure holds for the CPU kind it was measured on)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says, else "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
