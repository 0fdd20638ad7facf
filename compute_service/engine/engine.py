"""The engine loop: schedule, run, update; one allocator step (a memory-service RPC) per step,
except decode steps the memory service need not see (scheduler.py, rule 7).

The update appends what the model's output decided: the token choice (biases, grammar masks,
sampling) is token_chooser.py's, what callers read (logprobs, text, stops, deltas) is
output_processor.py's.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import torch

from memory_service.api import cache_namespace
from pagedserve.errors import AlreadyExistsError, echo
from pagedserve.log import get_logger

from compute_service.engine.allocator import KvAllocator
from compute_service.engine.config import EngineConfig
from compute_service.model.model import CausalLM
from compute_service.model.model_config import ModelConfig
from compute_service.engine.model_runner import ModelRunner, StepLogits
from compute_service.engine.faults import DetokenizeFault
from compute_service.engine.output_processor import OutputProcessor
from compute_service.engine.outputs import RequestDelta
from compute_service.engine.request import EngineLoad, GenerateInput, Request, check_input
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.scheduler import ScheduledSeq, Scheduler
from compute_service.engine import speculative
from compute_service.engine.sequence import FinishReason, Sequence
from compute_service.engine.token_chooser import TokenChooser
from compute_service.structured.grammar_compiler import GrammarCompiler

log = get_logger("engine")

# Weight of the newest step in the prefill speed's moving average (sent to the memory service).
PREFILL_SPEED_EWMA = 0.3
# How long a step with nothing to run but sequences parked on tier loads waits before asking again.
LOADING_POLL_S = 0.002

class Engine:
    """Continuous-batching engine over a model and a KV allocator.

    Not thread-safe: one thread calls ``add_request``/``abort``/``step`` (the service's engine loop
    thread, or the caller of ``LLM.generate``). ``check_request`` reads only constants and may be
    called from any thread.

    Args:
        model: our model; config: its ModelConfig; tokenizer: for text (None = token ids only).
        memory: the KV allocator (engine/allocator.py): a memory-service client, or the in-process one;
            its pool is what the model reads and writes.
        config: budgets.
        grammars: compiles structured-output constraints for this tokenizer; shared by the engines
            a service builds around one model (None = made on the first constrained request).
        detokenize_fault: test only (engine/faults.py): requests it names fail in detokenization.
            Also settable as the attribute of the same name before requests are added.
    """

    def __init__(self, model: CausalLM, model_config: ModelConfig, tokenizer: Any | None,
                 memory: KvAllocator, config: EngineConfig, grammars: GrammarCompiler | None = None,
                 detokenize_fault: DetokenizeFault | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.chooser = TokenChooser(model_config, tokenizer, config, self._fail_request, grammars)
        self.masker = self.chooser.masker  # its counters are read by benchmarks and tests
        self.output = OutputProcessor(model_config.eos_token_ids, model_config.max_position, self._fail_request)
        self.memory = memory
        self.config = config
        self.runner = ModelRunner(model, memory.pool, memory.block_size)
        self.scheduler = Scheduler(config, memory.block_size, memory.num_blocks, memory.reserved)
        self.requests: dict[str, Request] = {}
        self._aborted_ids: set[str] = set()
        self._seq_counter = itertools.count()
        self.num_steps = 0
        self._num_available_blocks = memory.num_blocks  # after the last step, both pools
        # Prefix-cache hit rate as this engine saw it: prompt tokens at admission, and cached ones.
        self._num_prompt_tokens_admitted = 0
        self._num_prompt_tokens_cached = 0
        self.num_failed_requests = 0  # ended by a failure of their own (finish_reason "error")
        # Prompt tokens per second of the steps that ran a prefill (0 until one has): the memory
        # service weighs loading a cached prefix from its tier against it.
        self.prefill_tokens_per_s = 0.0
        self.num_draft_tokens = 0  # speculative drafts computed, and how many of them were accepted
        self.num_accepted_draft_tokens = 0
        self.detokenize_fault = detokenize_fault

    # --- requests ---------------------------------------------------------------------------

    def check_request(self, request: GenerateInput) -> None:
        """Raise InvalidArgument (naming the field) unless this request can run on this model and
        pool (request.py's ``check_input``)."""
        check_input(request, self.model_config, self.tokenizer is not None, self.memory.block_size,
                    self.scheduler.num_general_blocks)

    @property
    def grammars(self) -> GrammarCompiler:
        """The constraint compiler (the token chooser's; built on first use)."""
        return self.chooser.grammars

    def close(self) -> None:
        """Stop what this engine started itself: the grammar compiler's worker processes."""
        self.chooser.close()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str = "", tenant: str = "",
                    grammar: Any | None = None) -> None:
        """Queue a request given by its fields (``add`` takes them in one object)."""
        self.add(GenerateInput(request_id, list(prompt_token_ids), params, priority, cache_salt, tenant),
                 grammar=grammar)

    def add(self, new: GenerateInput, grammar: Any | None = None) -> None:
        """Queue a request. Raises AlreadyExistsError for a duplicate id, InvalidArgument for a
        request that cannot run.

        Checked here even after the servicer's check: the engine it checked against may have been
        replaced since (re-attached to a memory service with a different pool).

        ``grammar``: ``params.constraint`` compiled by ``self.grammars`` (the service compiles off
        this thread first); when None for a constrained request it is compiled here, blocking.
        """
        if new.request_id in self.requests:
            raise AlreadyExistsError(f"request_id {echo(new.request_id)} is already running")
        self.check_request(new)
        if new.params.constraint is not None and grammar is None:
            grammar = self.grammars.compile(new.params.constraint)
        request = Request(new.request_id, list(new.prompt_token_ids), new.params, self.tokenizer, new.priority,
                          new.cache_salt, new.tenant, grammar=grammar)
        seq = self._new_seq(request, index=0)
        self.requests[new.request_id] = request
        self.scheduler.add(seq)
        log.debug("queued", request_id=new.request_id, num_prompt_tokens=len(new.prompt_token_ids),
                  max_tokens=new.params.max_tokens, n=new.params.n, priority=new.priority)

    def _new_seq(self, request: Request, index: int) -> Sequence:
        seq = Sequence(
            # Sequence ids are unique per memory service: other clients may share it.
            seq_id=f"{self.memory.client_id}/{next(self._seq_counter)}",
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            params=request.params,
            priority=request.priority,
            cache_namespace=cache_namespace(self.model_config.name, request.cache_salt),
            tenant=request.tenant,
            index=index,
            generator=self.chooser.new_generator(request.params, index),  # seeded requests only
            matcher=self.chooser.new_matcher(request.grammar),
        )
        fault = self.detokenize_fault and self.detokenize_fault.detokenizer_for(
            request.prompt_token_ids, self.tokenizer, request.params.stop)
        request.add_seq(seq, fault or None)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns False when it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        log.info("aborted", request_id=request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish(FinishReason.ABORT)
                self.scheduler.finish(seq)
        self._aborted_ids.add(request_id)  # reported by the next step
        return True

    def pause(self, request_id: str) -> None:
        """Stop scheduling a request (its blocks stay) until ``resume``: its consumer is behind."""
        self._set_paused(request_id, True)

    def resume(self, request_id: str) -> None:
        self._set_paused(request_id, False)

    def _set_paused(self, request_id: str, paused: bool) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.is_paused = paused
            for seq in request.seqs:
                seq.is_paused = paused

    @property
    def num_prompt_tokens_cached(self) -> int:
        """Prompt tokens served from the prefix cache (pool or tier) at admissions, readmissions
        after a preemption included."""
        return self._num_prompt_tokens_cached

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.scheduler.has_work()

    def load(self) -> EngineLoad:
        """Queue lengths, outstanding tokens and KV usage, for routing (call from the engine thread)."""
        admitted = self._num_prompt_tokens_admitted
        return EngineLoad.of(self.scheduler.running, self.scheduler.waiting,
                             kv_usage=1.0 - self._num_available_blocks / self.memory.num_blocks,
                             prefix_cache_hit_rate=self._num_prompt_tokens_cached / admitted if admitted else 0.0)

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One step; returns what is new for each request that produced tokens or finished."""
        scheduled = self._schedule()
        step = self._run(scheduled) if scheduled else None
        return self._update(scheduled, step)

    def _run(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        """The model's forward; a step that prefills (a chunk of more than one token) also updates
        ``prefill_tokens_per_s``."""
        start = time.perf_counter()
        step = self.runner.run(scheduled)
        if any(item.num_new_tokens > 1 for item in scheduled):
            elapsed_s = time.perf_counter() - start
            if elapsed_s > 0:
                speed = sum(item.num_new_tokens for item in scheduled) / elapsed_s
                old = self.prefill_tokens_per_s
                self.prefill_tokens_per_s = speed if not old else old + PREFILL_SPEED_EWMA * (speed - old)
        return step

    def _schedule(self) -> list[ScheduledSeq]:
        plan = self.scheduler.schedule()
        if not plan.ops:
            if self.scheduler.waiting:
                if not self.scheduler.has_admissible():
                    time.sleep(LOADING_POLL_S)  # only tier loads to wait for: do not spin on the RPC
                # Nothing fits by the counts of the last step, and without a step they never change:
                # ask again (another client of the memory service may have freed blocks since, or a
                # tier load ended).
                reply = self.memory.step_with_counts([], self.prefill_tokens_per_s)
                self.scheduler.apply_results(plan, [], reply.num_available_blocks, reply.num_available_reserved_blocks)
                self.scheduler.loads_ended(reply.loaded_seq_ids)
            return []
        if plan.is_deferrable:  # decodes within their blocks: the memory service hears of them later
            scheduled = self.scheduler.apply_deferred(plan)
        else:
            reply = self.memory.step_with_counts(plan.ops, self.prefill_tokens_per_s)  # the step's one RPC
            self._num_available_blocks = reply.num_available_blocks + reply.num_available_reserved_blocks
            scheduled = self.scheduler.apply_results(plan, reply.results, reply.num_available_blocks,
                                                     reply.num_available_reserved_blocks)
            self.scheduler.loads_ended(reply.loaded_seq_ids)
        self.num_steps += 1
        if self.config.num_speculative_tokens:
            speculative.attach_drafts(scheduled, self.config.num_speculative_tokens,
                                      self.config.max_num_batched_tokens, self.memory.block_size,
                                      self.model_config.max_position)
        return scheduled

    def _update(self, scheduled: list[ScheduledSeq], step: StepLogits | None) -> list[RequestDelta]:
        """Advance the scheduled sequences by the model's output: count, score, choose and append
        tokens, fork n > 1 completions, keep the drafts the model agreed with; then the deltas."""
        touched: dict[str, Request] = {}
        to_sample: list[tuple[int, Sequence]] = []
        logits = step.logits if step is not None else None
        for row, item in enumerate(scheduled):
            seq = item.seq
            if seq.num_computed_tokens == seq.num_cached_tokens:
                # First chunk since (re)admission: the one moment both counters are equal.
                self._num_prompt_tokens_admitted += seq.num_tokens
                self._num_prompt_tokens_cached += seq.num_cached_tokens
            if step is not None and row in step.prompt_logprobs:
                scored = step.prompt_logprobs[row]
                self.requests[seq.request_id].prompt_logprobs.extend(scored)
                seq.add_prompt_logprobs(len(scored))
            if step is not None and row in step.pooled:
                seq.add_pooled(*step.pooled[row])
            if not seq.advance(item.num_new_tokens, is_appended=item.is_appended):
                continue  # a prompt chunk before the last
            if seq.params.max_tokens == 0:  # the prompt scored or pooled, nothing to generate
                seq.finish(FinishReason.LENGTH)
                self.scheduler.finish(seq)
                touched[seq.request_id] = self.requests[seq.request_id]
            else:  # prompt done or a decode step: sample
                to_sample.append((row, seq))
        if to_sample:
            # (B, V) raw logits, this step's own tensor (nothing else reads it): the rows that sample,
            # without a copy when they all do (every decode step).
            rows = logits if len(to_sample) == logits.shape[0] else logits[[row for row, _ in to_sample]]
            seqs = [seq for _, seq in to_sample]
            tokens = self.chooser.choose(rows, seqs)
            drafts = speculative.StepDrafts(scheduled, logits)  # the model's verdict on the drafts
            self.num_draft_tokens += drafts.num_draft_tokens
            for index, ((row, seq), token) in enumerate(zip(to_sample, tokens)):
                touched[seq.request_id] = self.requests[seq.request_id]
                if token is None or seq.finish_reason is FinishReason.ERROR:
                    continue  # its request failed (this step): nothing more for it
                # Per sequence, so that a failure of one request's own work ends that request alone.
                try:
                    if seq.params.n > 1 and seq.index == 0 and not seq.output_token_ids:
                        self._fork_children(seq, rows[index])
                    # (No logprobs with drafts: such sequences get none.)
                    append_token = functools.partial(self._append_token, seq, logits=rows, row=index)
                    self.num_accepted_draft_tokens += drafts.append(row, seq, token, append_token)
                except Exception as exc:  # reported as the request's error, logged with its traceback
                    self._fail_request(seq.request_id, "postprocessing", exc)
        for request_id in self._aborted_ids:
            touched[request_id] = self.requests[request_id]
        self._aborted_ids.clear()
        deltas = self.output.deltas(touched.values())
        for delta in deltas:
            if delta.finished:
                del self.requests[delta.request_id]
        return deltas

    def _fail_request(self, request_id: str, stage: str, exc: Exception) -> None:
        """End one request with finish_reason "error"; the others keep running."""
        request = self.requests[request_id]
        log.error("request_failed", request_id=request_id, stage=stage, error=type(exc).__name__, exc_info=exc)
        if request.error is None:
            self.num_failed_requests += 1
        for seq in request.fail(f"{stage} failed ({type(exc).__name__})"):
            self.scheduler.finish(seq)  # its blocks are freed by the next step

    def _fork_children(self, parent: Sequence, row: torch.Tensor) -> None:
        """n > 1: the other completions share the parent's prompt blocks (ForkOp, copy-on-write)."""
        request = self.requests[parent.request_id]
        for index in range(1, parent.params.n):
            child = self._new_seq(request, index)
            parent.fork(child)
            self.scheduler.add_fork(parent, child)
            [token] = self.chooser.choose(row[None], [child])
            if token is not None:  # else the request has failed already
                self._append_token(child, token, row[None], 0)

    def _append_token(self, seq: Sequence, token: int, logits: torch.Tensor, row: int) -> None:
        """Append ``token``, chosen from ``logits[row]``: its grammar advances, its completion gets the
        token's logprobs and text, and a stop frees it in the scheduler."""
        self.chooser.accept(seq, token)
        if self.output.append_token(self.requests[seq.request_id].completions[seq.index], token, logits, row):
            self.scheduler.finish(seq)
