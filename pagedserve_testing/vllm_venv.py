"""Where vLLM's CPU build lives on this machine: the git-ignored venv that `scripts/vllm_venv.sh` makes.

The benchmarks run vLLM from it as the peer (benchmarks/vllm_peer.py), and tests that check our
output against vLLM's own classes (the KV events) run its python on a subscriber script; vLLM pins
its own torch and transformers, so it never enters the project's venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_SCRIPT = REPO / "scripts" / "vllm_venv.sh"


def vllm_python(install: bool = True) -> Path:
    """The python of vLLM's venv: ``$VLLM_PYTHON``, else ``.venv-vllm/bin/python``, created by
    ``scripts/vllm_venv.sh`` when missing and ``install`` (it downloads a few GB the first time)."""
    explicit = os.environ.get("VLLM_PYTHON")
    if explicit:
        return Path(explicit)
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists() and install:
        print(f"[vllm_venv] creating vLLM's venv with {VENV_SCRIPT.name} (first use; downloads a lot)",
              file=sys.stderr, flush=True)
        subprocess.run(["bash", str(VENV_SCRIPT)], check=True, stdout=sys.stderr)
    if not python.exists():
        raise FileNotFoundError(f"no vLLM venv at {python}: run scripts/vllm_venv.sh or set VLLM_PYTHON")
    return python
