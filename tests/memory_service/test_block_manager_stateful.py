"""Random op sequences against the block manager, checked against a model after every step.

The model keeps, per live sequence, its owner, its tokens and the block table the op results
imply (tables from AllocateOp/ForkOp, appended blocks and copy-on-write pairs from AppendOp), and
a simulated pool: the (namespace, token) written into every slot. Rules apply single ops, mixed
batches of one client (as a scheduler step sends them), bad batches and client releases. After an
apply the model writes the new tokens into their slots in op order, as the compute service's
forward pass would, those of a sequence that a later op of the batch freed included (the manager
keeps its blocks until the batch ends); ``copy_block`` copies slots when the manager calls it,
before any of the batch's writes. Invariants:

- ``check_integrity()`` holds;
- the manager's block tables equal the model's, and each refcount is the number of model tables
  holding the block;
- every slot a live sequence covers holds that sequence's own token: prefix sharing and
  copy-on-write never hand a sequence somebody else's data;
- a low-priority sequence never takes (as opposed to shares) a reserved block;
- an op that fails (out of blocks, or a bad batch) changes nothing;
- commit before share: a block written in a client's last batch (not yet acknowledged by its next
  one) is never a prefix hit of another client, and one written in the last batch of a client that
  was then released is never a prefix hit of anybody until it is taken anew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from memory_service.manager.block_manager import AllocateOp, AppendOp, BlockManager, BlockManagerConfig, ForkOp, FreeOp

pytestmark = pytest.mark.unit

# A tiny alphabet and a few shared openings make prefix hits, twins and evictions frequent.
TOKEN = st.integers(0, 2)
OPENINGS = [[0] * 8, [0, 0, 0, 0, 1, 1, 1, 1], [1, 2] * 4, [0, 0, 1, 1, 2, 2], [2, 2, 2]]


@dataclass
class ModelSequence:
    client_id: str
    namespace: str
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    priority: int = 0


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager: BlockManager | None = None
        self.seqs: dict[str, ModelSequence] = {}
        self.clients: list[str] = []
        self.slots: dict[int, list[tuple[str, int] | None]] = {}
        self.copies_made: list[tuple[int, int]] = []
        self.next_id = 0
        self.unacked: dict[str, set[int]] = {}  # client -> blocks written in its last batch
        self.poisoned: set[int] = set()  # written in the last batch of a released client

    # --- setup ----------------------------------------------------------------------------

    @initialize(
        num_blocks=st.integers(6, 32),
        block_size=st.sampled_from([1, 2, 2, 4, 4]),
        enable_prefix_caching=st.booleans(),
        reserved_fraction=st.sampled_from([0.0, 0.25, 0.5]),
    )
    def setup(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, reserved_fraction: float) -> None:
        config = BlockManagerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            reserved_blocks=int(num_blocks * reserved_fraction),
        )
        self.manager = BlockManager(config, copy_block=self.copy_block)
        self.slots = {b: [None] * block_size for b in range(num_blocks)}
        self.add_client()

    def copy_block(self, src: int, dst: int) -> None:
        self.slots[dst] = list(self.slots[src])
        self.copies_made.append((src, dst))

    # --- helpers --------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.manager.config.block_size

    @property
    def capacity(self) -> int:
        return self.manager.config.num_blocks * self.block_size

    def new_id(self, prefix: str) -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def write(self, seq: ModelSequence, start: int) -> None:
        """The compute service writes tokens [start, len) of ``seq`` into their slots."""
        for pos in range(start, len(seq.token_ids)):
            block_id = seq.block_table[pos // self.block_size]
            self.slots[block_id][pos % self.block_size] = (seq.namespace, seq.token_ids[pos])
            self.unacked[seq.client_id].add(block_id)

    def apply(self, client_id: str, ops: list) -> list:
        """The client's next batch: it acknowledges the writes of its previous one."""
        results = self.manager.apply(client_id, ops)
        self.unacked[client_id] = set()
        return results

    def check_shared_prefix(self, client_id: str, block_ids: list[int], num_cached_blocks: int) -> None:
        """Blocks shared from the cache were committed; the others are newly taken."""
        for block_id in block_ids[:num_cached_blocks]:
            assert block_id not in self.poisoned, f"block {block_id} of a dead writer was shared"
            for other, unacked in self.unacked.items():
                assert other == client_id or block_id not in unacked, f"uncommitted block {block_id} was shared"
        self.taken(block_ids[num_cached_blocks:])

    def taken(self, block_ids: list[int]) -> None:
        """Blocks newly taken: whatever an earlier writer left in them is overwritten."""
        self.poisoned.difference_update(block_ids)
        for unacked in self.unacked.values():
            unacked.difference_update(block_ids)

    def check_new_blocks_pool(self, seq: ModelSequence, block_ids: list[int]) -> None:
        """Blocks a low-priority sequence takes (not shares) come from the general pool."""
        if seq.priority < self.manager.config.reserved_min_priority:
            assert all(b < self.manager.config.num_general_blocks for b in block_ids), block_ids

    def snapshot(self) -> tuple:
        return (
            self.manager.stats(),
            {s: self.manager.block_table(q.client_id, s) for s, q in self.seqs.items()},
            [self.manager.ref_count(b) for b in range(self.manager.config.num_blocks)],
        )

    def live_seq(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.seqs)))

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        opening = data.draw(st.sampled_from([[], *OPENINGS]))
        prompt = opening + data.draw(st.lists(TOKEN, max_size=4))
        prompt = prompt or [data.draw(TOKEN)]
        return prompt[: self.capacity]

    # --- rules ----------------------------------------------------------------------------

    # Rules without preconditions (a rule with nothing to do returns): hypothesis gives up on
    # examples where it cannot find an enabled rule quickly.

    @rule()
    def add_client(self) -> None:
        if len(self.clients) >= 3:
            return
        client_id = self.new_id("client")
        self.manager.add_client(client_id)
        self.clients.append(client_id)
        self.unacked[client_id] = set()

    @rule(data=st.data(), priority=st.sampled_from([0, 1]), namespace=st.sampled_from(["", "salt"]))
    def allocate(self, data: st.DataObject, priority: int, namespace: str) -> None:
        client_id = data.draw(st.sampled_from(self.clients))
        prompt = self.draw_prompt(data)
        max_new = data.draw(st.integers(1, len(prompt) + 2))
        seq_id = self.new_id("s")
        before = self.snapshot()
        [result] = self.apply(client_id, [AllocateOp(seq_id, prompt, max_new, priority, namespace)])
        if not result.ok:
            event("allocate: out of blocks")
            assert self.snapshot() == before and not self.manager.has_sequence(client_id, seq_id)
            return
        event(f"allocate: {'prefix hit' if result.num_cached_tokens else 'no hit'}")
        if max(result.block_ids) >= self.manager.config.num_general_blocks:
            event("allocate: reserved block")
        bs = self.block_size
        num_cached, num_new = result.num_cached_tokens, result.num_new_tokens
        assert num_cached % bs == 0 and num_cached <= (len(prompt) - 1) // bs * bs
        assert num_new == min(len(prompt) - num_cached, max_new)
        if not self.manager.config.enable_prefix_caching:
            assert num_cached == 0
        seq = ModelSequence(client_id, namespace, prompt[: num_cached + num_new], list(result.block_ids), priority)
        self.check_shared_prefix(client_id, seq.block_table, num_cached // bs)
        assert len(seq.block_table) == -(-len(seq.token_ids) // bs)
        self.check_new_blocks_pool(seq, seq.block_table[num_cached // bs :])
        # The shared prefix must already hold exactly these tokens, in this namespace.
        for pos in range(num_cached):
            assert self.slots[seq.block_table[pos // bs]][pos % bs] == (namespace, prompt[pos])
        self.seqs[seq_id] = seq
        self.write(seq, num_cached)

    @rule(data=st.data(), new_tokens=st.lists(TOKEN, min_size=1, max_size=5))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        if not self.seqs:
            return
        seq_id = self.live_seq(data)
        seq = self.seqs[seq_id]
        if len(seq.token_ids) + len(new_tokens) > self.capacity:
            return
        before = self.snapshot()
        self.copies_made.clear()
        [result] = self.apply(seq.client_id, [AppendOp(seq_id, new_tokens)])
        if not result.ok:
            event("append: out of blocks")
            assert self.snapshot() == before and not self.copies_made
            return
        if result.copies:
            event("append: copy-on-write")
        assert result.copies == self.copies_made
        self.check_new_blocks_pool(seq, result.block_ids + [dst for _, dst in result.copies])
        self.taken(result.block_ids + [dst for _, dst in result.copies])
        for src, dst in result.copies:
            position = seq.block_table.index(src)
            assert position == len(seq.block_table) - 1, "only the partial last block is copied"
            seq.block_table[position] = dst
        seq.block_table += result.block_ids
        start = len(seq.token_ids)
        seq.token_ids += new_tokens
        assert len(seq.block_table) == -(-len(seq.token_ids) // self.block_size)
        self.write(seq, start)

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        if not self.seqs:
            return
        parent_id = self.live_seq(data)
        parent = self.seqs[parent_id]
        child_id = self.new_id("f")
        [result] = self.apply(parent.client_id, [ForkOp(parent_id, child_id)])
        assert result.ok and result.block_ids == parent.block_table
        self.seqs[child_id] = ModelSequence(
            parent.client_id, parent.namespace, list(parent.token_ids), list(parent.block_table), parent.priority
        )

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.seqs:
            return
        seq_id = self.live_seq(data)
        seq = self.seqs.pop(seq_id)
        [result] = self.apply(seq.client_id, [FreeOp(seq_id)])
        assert result.ok and result.block_ids == seq.block_table

    @rule(data=st.data())
    def release_client(self, data: st.DataObject) -> None:
        if len(self.clients) < 2:
            return
        client_id = data.draw(st.sampled_from(self.clients))
        owned = [s for s, seq in self.seqs.items() if seq.client_id == client_id]
        assert self.manager.release_client(client_id) == len(owned)
        for seq_id in owned:
            del self.seqs[seq_id]
        self.clients.remove(client_id)
        self.poisoned |= self.unacked.pop(client_id)
        assert not self.manager.has_client(client_id)

    @rule(data=st.data())
    def mixed_batch(self, data: st.DataObject) -> None:
        """Several ops of one client in one apply(), as a scheduler step sends them."""
        client_id = data.draw(st.sampled_from(self.clients))
        # Model view of the batch as it builds: seq_id -> most tokens it may hold, None once freed.
        upper: dict[str, int | None] = {s: len(q.token_ids) for s, q in self.seqs.items() if q.client_id == client_id}
        pending: set[str] = set()  # allocated or appended in this batch
        frozen: set[str] = set()  # forked from (or as) a pending sequence: no more appends this batch
        ops: list = []
        prompts: dict[str, list[int]] = {}
        for _ in range(data.draw(st.integers(2, 5))):
            live = sorted(s for s, n in upper.items() if n is not None)
            kind = data.draw(st.sampled_from(["allocate", "append", "fork", "free"] if live else ["allocate"]))
            if kind == "allocate":
                seq_id, prompt = self.new_id("s"), self.draw_prompt(data)
                priority = data.draw(st.sampled_from([0, 1]))
                ops.append(AllocateOp(seq_id, prompt, data.draw(st.integers(1, len(prompt) + 2)), priority))
                upper[seq_id], prompts[seq_id] = len(prompt), prompt
                pending.add(seq_id)
            elif kind == "append":
                seq_id = data.draw(st.sampled_from(live))
                new_tokens = data.draw(st.lists(TOKEN, min_size=1, max_size=3))
                if seq_id not in frozen and upper[seq_id] + len(new_tokens) <= self.capacity:
                    ops.append(AppendOp(seq_id, new_tokens))
                    upper[seq_id] += len(new_tokens)
                    pending.add(seq_id)
            elif kind == "fork":
                parent_id, child_id = data.draw(st.sampled_from(live)), self.new_id("f")
                ops.append(ForkOp(parent_id, child_id))
                upper[child_id] = upper[parent_id]
                if parent_id in pending or parent_id in frozen:
                    frozen.update((parent_id, child_id))
            else:
                seq_id = data.draw(st.sampled_from(live))
                ops.append(FreeOp(seq_id))
                upper[seq_id] = None
                pending.discard(seq_id)
                frozen.discard(seq_id)

        self.copies_made.clear()
        results = self.apply(client_id, ops)
        assert len(results) == len(ops)
        # Replay the results on the model, in order; the step's K/V is written in the same order.
        failed: set[str] = set()
        all_copies = []
        for op, result in zip(ops, results):
            if isinstance(op, AllocateOp):
                if not result.ok:
                    failed.add(op.seq_id)
                    continue
                failed.discard(op.seq_id)
                prompt = prompts[op.seq_id]
                num_cached = result.num_cached_tokens
                seq = ModelSequence(
                    client_id, "", prompt[: num_cached + result.num_new_tokens], list(result.block_ids), op.priority
                )
                self.check_new_blocks_pool(seq, seq.block_table[num_cached // self.block_size :])
                self.check_shared_prefix(client_id, seq.block_table, num_cached // self.block_size)
                for pos in range(num_cached):
                    assert self.slots[seq.block_table[pos // self.block_size]][pos % self.block_size] == (
                        "",
                        prompt[pos],
                    )
                self.seqs[op.seq_id] = seq
                self.write(seq, num_cached)
            elif isinstance(op, AppendOp):
                if op.seq_id in failed or not result.ok:
                    assert not result.ok and not result.block_ids
                    continue
                seq = self.seqs[op.seq_id]
                for src, dst in result.copies:
                    seq.block_table[seq.block_table.index(src)] = dst
                all_copies += result.copies
                self.check_new_blocks_pool(seq, result.block_ids + [dst for _, dst in result.copies])
                self.taken(result.block_ids + [dst for _, dst in result.copies])
                seq.block_table += result.block_ids
                start = len(seq.token_ids)
                seq.token_ids += op.token_ids
                self.write(seq, start)
            elif isinstance(op, ForkOp):
                if op.parent_seq_id in failed:
                    assert not result.ok
                    failed.add(op.child_seq_id)
                    continue
                failed.discard(op.child_seq_id)
                parent = self.seqs[op.parent_seq_id]
                assert result.ok and result.block_ids == parent.block_table
                self.seqs[op.child_seq_id] = ModelSequence(
                    client_id, parent.namespace, list(parent.token_ids), list(parent.block_table), parent.priority
                )
            elif op.seq_id in failed:
                assert not result.ok
            else:
                assert result.ok and result.block_ids == self.seqs.pop(op.seq_id).block_table
        assert all_copies == self.copies_made

    @rule(data=st.data())
    def bad_batch_changes_nothing(self, data: st.DataObject) -> None:
        if not self.seqs:
            return
        seq_id = self.live_seq(data)
        seq = self.seqs[seq_id]
        bad = data.draw(
            st.sampled_from(
                [
                    [AppendOp(seq_id, [-1])],
                    [AppendOp(seq_id, [])],
                    [AllocateOp(seq_id, [1], 1)],
                    [ForkOp("missing", "x")],
                    [FreeOp(seq_id), AppendOp(seq_id, [1])],
                    [AppendOp(seq_id, [0] * (self.capacity - len(seq.token_ids) + 1))],
                ]
            )
        )
        before = self.snapshot()
        try:
            # Valid ops in front of the bad ones must not be applied either.
            self.manager.apply(seq.client_id, [AllocateOp(self.new_id("s"), [0], 1), AppendOp(seq_id, [0]), *bad])
        except ValueError:
            pass
        else:
            raise AssertionError(f"{bad} was accepted")
        assert self.snapshot() == before

    def teardown(self) -> None:
        if self.manager is not None and self.manager.stats().num_evictions:
            event("evicted")

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def integrity_holds(self) -> None:
        if self.manager is not None:
            self.manager.check_integrity()

    @invariant()
    def tables_and_refcounts_match_the_model(self) -> None:
        if self.manager is None:
            return
        expected = [0] * self.manager.config.num_blocks
        for seq_id, seq in self.seqs.items():
            assert self.manager.block_table(seq.client_id, seq_id) == seq.block_table
            for block_id in seq.block_table:
                expected[block_id] += 1
        assert [self.manager.ref_count(b) for b in range(len(expected))] == expected
        stats = self.manager.stats()
        assert stats.num_sequences == len(self.seqs)
        assert sum(p.num_used_blocks for p in stats.pools) == sum(1 for n in expected if n)

    @invariant()
    def every_sequence_sees_its_own_tokens(self) -> None:
        for seq in self.seqs.values():
            for pos, token in enumerate(seq.token_ids):
                block_id = seq.block_table[pos // self.block_size]
                assert self.slots[block_id][pos % self.block_size] == (seq.namespace, token)


# Sized to take a few seconds (under 15 s on a loaded 2-core machine). Not derandomized: every run
# draws new examples, so the suite as a whole keeps exploring; print_blob prints the
# @reproduce_failure line of a failure.
BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
