"""Output processing: what callers read from the tokens the engine appends.

Each appended token gets its logprobs (when asked for), goes through its completion's incremental
detokenizer (which matches the stop strings in the text) and through the stop rules (stop.py); each
step ends with one ``RequestDelta`` per request that has news. The engine's loop only decides what
runs and appends what was chosen; everything a caller reads back is made here, after vLLM v1's
split of the engine core from its output processor.

Failures: a detokenizer that raises is a failure of its request alone. In ``append_token`` it
raises to the engine, which ends that request; in ``deltas`` (the detokenizer's final flush) the
request is ended here through ``fail_request`` and still gets its (failed) delta.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from compute_service.engine.outputs import RequestDelta
from compute_service.engine.request import Completion, Request
from compute_service.engine.sampler import token_logprobs
from compute_service.engine.stop import check_stop
from compute_service.engine.token_chooser import FailRequest
from pagedserve.log import get_logger

log = get_logger("engine")  # the engine's own events: its part, under its component name


class OutputProcessor:
    """Logprobs, detokenizing, stop checks and deltas.

    Args:
        eos_token_ids: the model's end tokens; max_position: its length (both for the stop rules).
        fail_request: ends one request with finish_reason "error" (the engine's).
    """

    def __init__(self, eos_token_ids: tuple[int, ...], max_position: int, fail_request: FailRequest) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_position = max_position
        self._fail_request = fail_request

    def append_token(self, completion: Completion, token: int, logits: torch.Tensor, row: int) -> bool:
        """Append ``token`` to the completion's sequence and check the stops.

        Args:
            completion: the sequence's completion (its detokenizer, logprobs, stop reason).
            token: the token chosen from ``logits[row]``, which its logprobs come from. The row is
                indexed only when logprobs need it: a view per sequence and step costs.
        Returns:
            Whether the sequence finished (it is then finished: the caller frees it in the scheduler).
        Raises:
            Whatever the detokenizer raises: a failure of this request alone.
        """
        seq, p = completion.seq, completion.seq.params
        seq.append_token(token)
        if p.logprobs is not None:
            completion.new_logprobs.extend(token_logprobs(logits[row : row + 1], [token], [p.logprobs]))
        stop_match = completion.detokenizer.add_tokens([token], check_stop=seq.num_output_tokens >= p.min_tokens)
        stopped = check_stop(token, seq.num_output_tokens, seq.num_tokens, p, self.eos_token_ids,
                             self.max_position, stop_match.stop if stop_match is not None else None)
        if stopped is None:
            return False
        reason, stop_reason = stopped
        if stop_reason is not None:
            completion.stop_reason = stop_reason
        seq.finish(reason)
        return True

    def deltas(self, requests: Iterable[Request]) -> list[RequestDelta]:
        """Each request's news since its last delta; logs the requests that finished with it."""
        requests = list(requests)
        deltas = [self._delta(request) for request in requests]
        for request, delta in zip(requests, deltas):
            if delta.finished:
                self._log_finished(request)
        return deltas

    def _delta(self, request: Request) -> RequestDelta:
        try:
            return request.delta()
        except Exception as exc:  # the detokenizer's final flush failed: the request's error
            self._fail_request(request.request_id, "detokenizing", exc)
            return request.delta()  # a failed completion's delta never detokenizes again

    @staticmethod
    def _log_finished(request: Request) -> None:
        for seq in request.seqs:  # one event per completion (n > 1 has several); no text in logs
            log.info("finished", request_id=request.request_id, index=seq.index, reason=seq.finish_reason.value,
                     num_prompt_tokens=seq.num_prompt_tokens, num_completion_tokens=seq.num_output_tokens,
                     num_cached_tokens=seq.num_cached_tokens)
