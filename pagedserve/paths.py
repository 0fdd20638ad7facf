"""Where pagedserve keeps what it builds on this machine (converted models, compiled kernels).

One rule, read at call time (never at import, so a test or a service can set it first): the
``cache_dir`` a caller passes, else ``$PAGEDSERVE_CACHE_DIR``, else ``~/.cache/pagedserve``.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PAGEDSERVE_CACHE_DIR"


def cache_dir(explicit: str | Path | None = None) -> Path:
    """The cache root (not created here): ``explicit``, else ``$PAGEDSERVE_CACHE_DIR``, else
    ``~/.cache/pagedserve``."""
    if explicit is not None:
        return Path(explicit).expanduser()
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "pagedserve"
