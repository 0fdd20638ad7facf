"""The engine loop: schedule, run, postprocess; one memory-service RPC per step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from memory_service.client import MemoryClient
from pagedserve.log import get_logger

from compute_service.config import EngineConfig
from compute_service.model import CausalLM
from compute_service.model_config import ModelConfig
from compute_service.model_runner import ModelRunner
from compute_service.outputs import CompletionOutput, RequestOutput
from compute_service.sampler import sample
from compute_service.sampling_params import SamplingParams
from compute_service.scheduler import ScheduledSeq, Scheduler
from compute_service.sequence import FinishReason, Sequence

log = get_logger("engine")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        aborted = any(s.finish_reason == FinishReason.ABORT for s in self.seqs)
        return all(s.is_finished for s in self.seqs) and (aborted or len(self.seqs) == self.params.n)


class Engine:
    """Continuous-batching engine over a model and a memory-service client.

    Args:
        model: our model; config: its ModelConfig; tokenizer: for text (None = token ids only).
        memory: an attached MemoryClient (its pool is what the model reads and writes).
        config: budgets.
    """

    def __init__(self, model: CausalLM, model_config: ModelConfig, tokenizer: Any | None,
                 memory: MemoryClient, config: EngineConfig) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.memory = memory
        self.config = config
        self.runner = ModelRunner(model, memory.pool, memory.block_size)
        available = memory.num_blocks - memory.num_reserved_blocks
        self.scheduler = Scheduler(config, memory.block_size, available, memory.num_reserved_blocks,
                                   memory.reserved_min_priority)
        self.requests: dict[str, Request] = {}
        self._aborted_ids: set[str] = set()
        self._seq_counter = itertools.count()
        self.num_steps = 0

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str = "") -> None:
        """Queue a request. Raises ValueError for a duplicate id or a prompt that cannot fit."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("prompt must have at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.model_config.max_position
        if len(prompt_token_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the model's limit is {limit}")
        capacity = (self.memory.num_blocks - self.memory.num_reserved_blocks) * self.memory.block_size
        if len(prompt_token_ids) + params.max_tokens > capacity:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceed the KV pool's "
                f"{capacity} tokens"
            )
        request = Request(request_id, list(prompt_token_ids), params)
        seq = self._new_seq(request, priority, cache_salt, index=0)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def _new_seq(self, request: Request, priority: int, cache_salt: str, index: int) -> Sequence:
        generator = None
        if not request.params.is_greedy:
            generator = torch.Generator()
            seed = request.params.seed if request.params.seed is not None else torch.seed()
            generator.manual_seed(seed + index)
        seq = Sequence(
            # Sequence ids are unique per memory service: other clients may share it.
            seq_id=f"{self.memory.client_id}/{next(self._seq_counter)}",
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            params=request.params,
            priority=priority,
            cache_namespace=f"{self.model_config.name}|{cache_salt}",
            index=index,
            generator=generator,
        )
        request.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns False when it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        log.info("aborted", request_id=request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(seq)
        self._aborted_ids.add(request_id)  # reported by the next step
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.scheduler.has_work()

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; returns the outputs of requests that produced tokens or finished."""
        scheduled = self._schedule()
        logits = self.runner.run(scheduled) if scheduled else None
        return self._postprocess(scheduled, logits)

    def _schedule(self) -> list[ScheduledSeq]:
        plan = self.scheduler.schedule()
        if not plan.ops:
            return []
        reply = self.memory.step_with_counts(plan.ops)  # the step's one memory-service RPC
        self.num_steps += 1
        return self.scheduler.apply_results(plan, reply.results, reply.num_available_blocks,
                                            reply.num_available_reserved_blocks)

    def _postprocess(self, scheduled: list[ScheduledSeq], logits: torch.Tensor | None) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        to_sample: list[tuple[int, Sequence]] = []
        for row, item in enumerate(scheduled):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:  # prompt done or a decode step: sample
                to_sample.append((row, seq))
        if to_sample:
            rows = logits[[row for row, _ in to_sample]]
            seqs = [seq for _, seq in to_sample]
            for seq, token, row in zip(seqs, sample(rows, seqs, self.model_config.eos_token_ids), rows):
                if seq.params.n > 1 and seq.index == 0 and not seq.output_token_ids:
                    self._fork_children(seq, row)
                self._append_token(seq, token)
                touched[seq.request_id] = self.requests[seq.request_id]
        for request_id in self._aborted_ids:
            touched[request_id] = self.requests[request_id]
        self._aborted_ids.clear()
        outputs = [self._output(r) for r in touched.values()]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
                for c in out.outputs:  # one event per completion (n > 1 has several); no text in logs
                    log.info("finished", request_id=out.request_id, index=c.index, reason=c.finish_reason,
                             num_prompt_tokens=len(out.prompt_token_ids), num_completion_tokens=len(c.token_ids),
                             num_cached_tokens=out.num_cached_tokens)
        return outputs

    def _fork_children(self, parent: Sequence, row: torch.Tensor) -> None:
        """n > 1: the other completions share the parent's prompt blocks (ForkOp, copy-on-write)."""
        request = self.requests[parent.request_id]
        for index in range(1, parent.params.n):
            child = self._new_seq(request, parent.priority, "", index)
            child.cache_namespace = parent.cache_namespace
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.block_table = list(parent.block_table)
            self.scheduler.add_fork(parent, child)
            [token] = sample(row[None], [child], self.model_config.eos_token_ids)
            self._append_token(child, token)

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        p = seq.params
        reason = None
        if token in self.model_config.eos_token_ids and not p.ignore_eos and seq.num_output_tokens > p.min_tokens:
            reason = FinishReason.EOS
        elif token in p.stop_token_ids and seq.num_output_tokens > p.min_tokens:
            reason = FinishReason.STOP
        elif p.stop and self.tokenizer is not None and seq.num_output_tokens >= p.min_tokens and self._stop_index(seq) is not None:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.model_config.max_position:
            reason = FinishReason.LENGTH
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _stop_index(self, seq: Sequence) -> int | None:
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        hits = [text.find(s) for s in seq.params.stop if s in text]
        return min(hits) if hits else None

    def _text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if seq.finish_reason == FinishReason.STOP and seq.params.stop:
            cut = self._stop_index(seq)
            text = text[:cut] if cut is not None else text
        return text

    def _output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index,
                    token_ids=list(s.output_token_ids),
                    text=self._text(s) if s.is_finished else "",
                    finish_reason=s.finish_reason.value if s.finish_reason else None,
                )
                for s in sorted(request.seqs, key=lambda s: s.index)
            ],
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            finished=finished,
        )
