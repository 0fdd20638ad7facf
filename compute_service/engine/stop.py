"""When a sequence stops: one pure function of the token just sampled and the counts after it.

Pure so that every rule and its order can be tested without a model (the stop string's match is
the detokenizer's, which keeps the text; it is passed in). The order is the rules' precedence: a
token that is both EOS and the last allowed one finishes as EOS.
"""

from __future__ import annotations

from collections.abc import Container

from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import FinishReason


def check_stop(token_id: int, num_output_tokens: int, num_tokens: int, params: SamplingParams,
               eos_token_ids: Container[int], max_position: int,
               matched_stop: str | None = None) -> tuple[FinishReason, str | int | None] | None:
    """Why the sequence stops after ``token_id``, or None when it goes on.

    Args:
        token_id: the token just appended.
        num_output_tokens, num_tokens: the sequence's counts with that token.
        params: its sampling parameters (``min_tokens``, ``ignore_eos``, ``stop_token_id_set``, ``max_tokens``).
        eos_token_ids: the model's end-of-sequence tokens.
        max_position: the model's length.
        matched_stop: the stop string the text now ends with (the detokenizer's match), if any.
    Returns:
        (finish reason, stop reason: the stop token or string, None for EOS and length), or None.
    """
    past_min = num_output_tokens > params.min_tokens
    if token_id in eos_token_ids and not params.ignore_eos and past_min:
        return FinishReason.EOS, None
    if token_id in params.stop_token_id_set and past_min:
        return FinishReason.STOP, token_id
    if matched_stop is not None:
        return FinishReason.STOP, matched_stop
    if num_output_tokens >= params.max_tokens or num_tokens >= max_position:
        return FinishReason.LENGTH, None
    return None
