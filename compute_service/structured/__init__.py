"""Structured outputs: constraints (JSON schema, JSON object, regex, choice, grammar) compiled by
xgrammar into grammars whose token masks steer sampling.

``constraint`` is plain data (no xgrammar import); ``grammar_compiler`` compiles and caches off the
engine thread; ``logits_mask`` fills and applies one step's masks for a batch.
"""

from compute_service.structured.constraint import Constraint

__all__ = ["Constraint"]
