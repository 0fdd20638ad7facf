"""The compute service: model, continuous-batching scheduler and engine over a paged KV pool.

``from compute_service import LLM`` gives the in-process engine. The names below load on first use
(PEP 562), so that importing a light module of this package (a config, a flag table) does not load
the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compute_service.engine.outputs import CompletionOutput, RequestOutput
    from compute_service.engine.sampling_params import SamplingParams
    from compute_service.llm import LLM
    from compute_service.structured.constraint import Constraint

_EXPORTS = {
    "LLM": "compute_service.llm",
    "CompletionOutput": "compute_service.engine.outputs",
    "RequestOutput": "compute_service.engine.outputs",
    "SamplingParams": "compute_service.engine.sampling_params",
    "Constraint": "compute_service.structured.constraint",
}
__all__ = ["LLM", "CompletionOutput", "Constraint", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'compute_service' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
