"""Continuous batching: which sequences run this step, with how many tokens, and who is preempted.

The scheduler plans one step as a list of memory-service ops (sent in ONE batched RPC by the
engine), then reads the results back. Rules, in order:

1. Budgets: at most ``max_num_seqs`` running sequences and ``max_num_batched_tokens`` new tokens per
   step. Running sequences go first (decodes cost one token each), so a long prompt, cut into
   chunks (chunked prefill), never stalls them; waiting sequences are admitted with what is left.
2. Priorities: higher priority first. Among the waiting sequences of the highest priority, fair
   between tenants (``Sequence.tenant``, from the gateway's tenant): the next admission goes to the
   tenant with the fewest running sequences (counting those admitted earlier in the same step),
   ties to the earliest arrival; within a tenant, first come, first served. So a tenant with
   nothing running gets the next free slot however long another tenant's backlog is, admissions
   alternate between tenants that all wait, and a tenant alone takes every slot as before.
   Running sequences are never preempted for fairness: it works through the free slots.
3. Out of blocks: the lowest-priority, most recently arrived running sequence is preempted (its
   blocks freed, recomputed later: preemption by recompute) and goes back to the front of its
   priority in the waiting queue. A waiting sequence may preempt only strictly lower priorities.
   Planning uses the memory service's count of available blocks after the previous step; if an op
   still fails (the count was stale), that sequence is preempted instead, nothing is lost.
4. Paused sequences (their stream's client is not reading; see the service's stream buffer) keep
   their blocks but get no tokens and no admission until resumed; they may still be preempted.
5. Tier loads: an admission the memory service answers ``loading`` (its cached prefix continues in
   a tier below the pool, memory.proto's OpResult.loading) stays waiting, parked: it is skipped
   by admission, and the others go ahead, until a later step reports its load over
   (``loads_ended``); its next AllocateOp then finds the prefix in the pool. One finished (aborted)
   before that AllocateOp got blocks is freed (a FreeOp, though it holds none): the service forgets it.
6. Admission watermark: while sequences run, a waiting one is admitted only if the
   ``admission_watermark`` share of the pool stays free afterwards, for the running ones to grow
   into. Without it a saturated engine fills the pool with prompts, then preempts (and later
   recomputes) the latest arrivals as soon as decodes need blocks (the preemptions and KV
   utilisation at each watermark: docs/benchmarks.md, "Admission watermark").
7. Steps the memory service need not see: a plan whose every op is a running sequence's one-token
   decode that fits in its last block without filling it is not sent (``StepPlan.is_deferrable``,
   ``apply_deferred``). Its tokens are written to slots the sequence's blocks already have, and
   they reach the memory service with the sequence's next append (``Sequence.num_unappended_tokens``,
   as accepted speculative drafts do). A step is sent whenever anything else happens: an admission,
   a free, a fork, a sequence waiting (its admission needs fresh counts, a tier load its
   ``loaded_seq_ids``), a new block, a last block shared with a fork (the copy on write), and the
   append that fills a block (so the prefix cache registers every full block as before), and the
   step after a sent one that registered full blocks (that step commits them for other clients).
   So the service's view of a sequence lags by a partial block at most; at one decoding sequence
   and 16-token blocks, 2 decode steps in 16 call it instead of 16 (one round trip through both
   processes' gRPC stacks each).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field

from memory_service.api import AllocateOp, AppendOp, ForkOp, FreeOp, OpResult, ReservedPool
from pagedserve.log import get_logger
from pagedserve.sampling_rules import num_blocks_for

from compute_service.engine.config import EngineConfig
from compute_service.engine.sequence import Sequence

log = get_logger("scheduler")


@dataclass
class ScheduledSeq:
    """A sequence running this step with ``num_new_tokens`` tokens to compute."""

    seq: Sequence
    num_new_tokens: int
    # Speculative drafts computed after the new token(s) (speculative.py): not in the memory
    # service's view, not counted in num_new_tokens.
    draft_token_ids: list[int] = field(default_factory=list)
    # False in a step not sent to the memory service (rule 7): the new token is appended later.
    is_appended: bool = True


@dataclass
class StepPlan:
    """One step's memory-service ops in three sections, applied in this order: forks (a parent
    that finished last step still has its blocks to share), frees (finished and preempted
    sequences, so their blocks serve this step), then appends and admissions (``work``)."""

    forks: list[ForkOp] = field(default_factory=list)
    frees: list[FreeOp] = field(default_factory=list)
    work: list[tuple[AppendOp | AllocateOp, Sequence]] = field(default_factory=list)
    # Every op is a decode the memory service need not see this step (rule 7): run it through
    # ``Scheduler.apply_deferred`` instead of sending it.
    is_deferrable: bool = False

    @property
    def ops(self) -> list:
        return [*self.forks, *self.frees, *(op for op, _ in self.work)]


def _next_fair(candidates: list[Sequence], num_running_by_tenant: Counter[str], num_tenants: int) -> Sequence:
    """The waiting sequence whose turn it is (rule 2): of the highest priority, the head (earliest
    arrival) of the tenant with the fewest running sequences, ties to the earliest head.

    Args:
        candidates: waiting sequences, sorted by (-priority, arrival) like ``Scheduler.waiting``.
        num_running_by_tenant: running sequences per tenant, admissions of this step included.
        num_tenants: how many tenants the candidates had at the step's start (the scan stops once it
            has a head of each: one tenant alone costs one look, not a walk of its backlog).
    """
    top = candidates[0].priority
    heads: dict[str, Sequence] = {}
    for seq in candidates:
        if seq.priority != top:
            break
        if seq.tenant not in heads:
            heads[seq.tenant] = seq
            if num_running_by_tenant[seq.tenant] == 0 or len(heads) == num_tenants:
                break  # nothing runs for it (no later head beats its arrival), or every tenant has its head
    return min(heads.values(), key=lambda s: (num_running_by_tenant[s.tenant], s.arrival))


class Scheduler:
    """Owns the waiting and running queues; knows nothing about tensors or protobuf."""

    def __init__(self, config: EngineConfig, block_size: int, num_blocks: int, reserved: ReservedPool) -> None:
        """Args: the engine's budgets; the allocator's block size, pool size and reserved pool (all
        of the pool available at first: counts come with each step's answer afterwards)."""
        self.config = config
        self.block_size = block_size
        self.waiting: list[Sequence] = []  # sorted by (-priority, arrival)
        self.running: list[Sequence] = []
        self._pending_free_ids: list[str] = []
        self._pending_forks: list[tuple[Sequence, Sequence]] = []  # (parent, child)
        self.reserved = reserved
        self.num_general_blocks = num_blocks - reserved.num_blocks
        self.num_available_blocks = self.num_general_blocks
        self.num_available_reserved_blocks = reserved.num_blocks
        self.num_preemptions = 0
        self.watermark_blocks = math.ceil(config.admission_watermark * self.num_general_blocks)
        # The last step sent may have registered full blocks: the next one is sent too (rule 7).
        self._must_send = False

    # --- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        keys = [(-s.priority, s.arrival) for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, (-seq.priority, seq.arrival)), seq)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares ``parent``'s blocks from the next step on (ForkOp before any append)."""
        self._pending_forks.append((parent, child))
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence; its blocks are freed in the next step's RPC (and a
        waiting one that was answered ``loading`` is freed there too: the memory service forgets it)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            if seq.has_tier_load:
                self._pending_free_ids.append(seq.seq_id)
        elif seq in self.running:
            self.running.remove(seq)
            if any(child is seq for _, child in self._pending_forks):
                # Finished before the service ever forked it: there is nothing to free there.
                self._pending_forks = [(p, c) for p, c in self._pending_forks if c is not seq]
            else:
                self._pending_free_ids.append(seq.seq_id)
                # Its blocks come back at the start of the next step's RPC, before that step's
                # admissions: plan with them (an estimate, like preemption's; shared blocks may stay).
                self.num_available_blocks += len(seq.block_table)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_free_ids)

    def _preempt(self, seq: Sequence, reason: str, plan: StepPlan | None = None) -> None:
        """Preemption by recompute: ``seq`` loses its blocks and waits at the front of its priority.

        While planning (``plan`` given) its blocks are freed by this step's RPC and counted as
        available at once (an estimate: shared blocks may stay in use). Once the RPC is sent (an op
        failed: no plan), they are freed by the next step's. Never a pending fork: ``schedule()``
        turns those into ForkOps before it preempts anyone. ``reason`` is for the log.
        """
        log.info("preempted", request_id=seq.request_id, seq_id=seq.seq_id, reason=reason,
                 num_computed_tokens=seq.num_computed_tokens, num_preemptions=seq.num_preemptions + 1)
        self.running.remove(seq)
        self.num_preemptions += 1
        if plan is None:
            self._pending_free_ids.append(seq.seq_id)
        else:
            plan.frees.append(FreeOp(seq.seq_id))
            self.num_available_blocks += len(seq.block_table)
        seq.reset_for_recompute()
        self.add(seq)

    def _available_for(self, priority: int) -> int:
        return self.reserved.num_available_for(priority, self.num_available_blocks, self.num_available_reserved_blocks)

    def _take(self, num_blocks: int) -> None:
        from_general = min(num_blocks, self.num_available_blocks)
        self.num_available_blocks -= from_general
        self.num_available_reserved_blocks -= num_blocks - from_general

    def _make_room(self, needed: int, seq: Sequence, plan: StepPlan, *, strictly_lower: bool) -> bool:
        """Preempt victims (lowest priority, latest arrival first) until ``needed`` blocks fit."""
        while self._available_for(seq.priority) < needed:
            candidates = [
                s for s in self.running
                if s is not seq and (s.priority < seq.priority if strictly_lower else s.priority <= seq.priority)
            ]
            if not candidates:
                return False
            victim = min(candidates, key=lambda s: (s.priority, -s.arrival))
            plan.work = [(op, s) for op, s in plan.work if s is not victim]  # undo its planned op
            self._preempt(victim, "make_room", plan)
        return True

    # --- planning ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step (see StepPlan for the order of its ops)."""
        plan = StepPlan(
            forks=[ForkOp(parent.seq_id, child.seq_id) for parent, child in self._pending_forks],
            frees=[FreeOp(seq_id) for seq_id in self._pending_free_ids],
        )
        self._pending_forks.clear()
        self._pending_free_ids.clear()

        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: (-s.priority, s.arrival))
        for seq in list(self.running):
            if seq not in self.running or budget == 0 or seq.is_paused:
                continue  # preempted by a higher-priority sequence earlier in this loop, or paused
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            needed = num_blocks_for(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table)
            if (needed > self._available_for(seq.priority)
                    and not self._make_room(needed, seq, plan, strictly_lower=False)):
                self._preempt(seq, "out_of_blocks", plan)  # it is itself the lowest: make way for the others
                continue
            self._take(max(needed, 0))
            plan.work.append((AppendOp(seq.seq_id, seq.tokens_to_append(n)), seq))
            budget -= n

        num_running = len(self.running)
        num_running_by_tenant = Counter(s.tenant for s in self.running)
        # Paused: admitted once their consumer reads; loading: once the memory service has their prefix.
        candidates = [s for s in self.waiting if not s.is_paused and not s.is_loading]
        num_tenants = len({s.tenant for s in candidates})
        while candidates:
            if budget == 0 or num_running >= self.config.max_num_seqs:
                break
            seq = _next_fair(candidates, num_running_by_tenant, num_tenants)
            n = min(seq.num_tokens, budget)  # planned as if nothing were cached: never over budget
            needed = num_blocks_for(n, self.block_size)
            available = self._available_for(seq.priority)
            if num_running and needed <= available < needed + self.watermark_blocks:
                break  # it fits, but would leave the running sequences no room to grow: wait
            if needed > available and not self._make_room(needed, seq, plan, strictly_lower=True):
                break  # its turn: no one behind it jumps the queue
            self._take(needed)
            plan.work.append((AllocateOp(seq.seq_id, seq.token_ids, n, seq.priority, seq.cache_namespace,
                                         skip_cache_read=seq.needs_every_position), seq))
            budget -= n
            num_running += 1
            candidates.remove(seq)
            num_running_by_tenant[seq.tenant] += 1
        plan.is_deferrable = (bool(plan.work) and not plan.forks and not plan.frees and not self.waiting
                              and not self._must_send and all(self._can_defer(op, seq) for op, seq in plan.work))
        return plan

    def _fills_block(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether appending the unappended tokens and ``num_new_tokens`` more fills one of ``seq``'s
        blocks (the memory service then registers it in the prefix cache)."""
        num_known = seq.num_computed_tokens - seq.num_unappended_tokens  # in the service's view
        return (seq.num_computed_tokens + num_new_tokens) // self.block_size > num_known // self.block_size

    def _can_defer(self, op: AppendOp | AllocateOp, seq: Sequence) -> bool:
        """Rule 7 for one op: a one-token decode of an output token into a slot its own last block has,
        not filling it."""
        return (isinstance(op, AppendOp) and seq.num_tokens - seq.num_computed_tokens == 1
                and seq.num_computed_tokens >= seq.num_prompt_tokens and not seq.is_last_block_shared
                and seq.num_computed_tokens < len(seq.block_table) * self.block_size
                and not self._fills_block(seq, 1))

    def apply_deferred(self, plan: StepPlan) -> list[ScheduledSeq]:
        """What runs in a step not sent to the memory service (rule 7): each decode of ``plan``."""
        if not plan.is_deferrable:
            raise RuntimeError("apply_deferred: this plan must be sent to the memory service")
        return [ScheduledSeq(seq, 1, is_appended=False) for _, seq in plan.work]

    def loads_ended(self, seq_ids: list[str]) -> None:
        """The memory service's tier loads for these sequences are over: admit them again (rule 5).
        Unknown ids (finished or aborted while loading) are ignored."""
        if seq_ids:
            ended = set(seq_ids)
            for seq in self.waiting:
                if seq.seq_id in ended:
                    seq.is_loading = False

    def has_admissible(self) -> bool:
        """Whether a waiting sequence could be admitted now if blocks allowed (not parked on a load)."""
        return any(not s.is_loading for s in self.waiting)

    def apply_results(self, plan: StepPlan, results: list[OpResult], num_available_blocks: int,
                      num_available_reserved_blocks: int) -> list[ScheduledSeq]:
        """Read the memory service's answers; returns what runs this step."""
        self.num_available_blocks = num_available_blocks
        self.num_available_reserved_blocks = num_available_reserved_blocks
        self._must_send = any(isinstance(op, AllocateOp)
                              or self._fills_block(seq, len(op.token_ids) - seq.num_unappended_tokens)
                              for op, seq in plan.work)
        scheduled: list[ScheduledSeq] = []
        num_other = len(plan.forks) + len(plan.frees)
        if len(results) != num_other + len(plan.work):
            raise RuntimeError(f"memory service answered {len(results)} results for {len(plan.ops)} ops")
        for (op, seq), result in zip(plan.work, results[num_other:]):
            if isinstance(op, AppendOp):
                if not result.ok:
                    self._preempt(seq, "append_failed")  # the count it was planned with was stale
                    continue
                num_new = len(op.token_ids) - seq.num_unappended_tokens  # the append also carried those
                seq.extend_blocks(result.block_ids, result.copies)
                scheduled.append(ScheduledSeq(seq, num_new))
            elif isinstance(op, AllocateOp):
                if not result.ok:
                    seq.is_loading = result.loading  # parked until its load ends (rule 5)
                    seq.has_tier_load |= result.loading
                    continue  # stays waiting; the service changed nothing
                seq.has_tier_load = False
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.admit(result.block_ids, result.num_cached_tokens)
                log.debug("admitted", request_id=seq.request_id, seq_id=seq.seq_id,
                          num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens)
                scheduled.append(ScheduledSeq(seq, result.num_new_tokens))
        return scheduled
