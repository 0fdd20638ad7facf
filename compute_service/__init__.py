"""The compute service: model, continuous-batching scheduler and engine over a paged KV pool.

``from compute_service import LLM`` gives the in-process engine.
"""

from compute_service.llm import LLM
from compute_service.engine.outputs import CompletionOutput, RequestOutput
from compute_service.engine.sampling_params import SamplingParams
from compute_service.structured.constraint import Constraint

__all__ = ["LLM", "CompletionOutput", "Constraint", "RequestOutput", "SamplingParams"]
