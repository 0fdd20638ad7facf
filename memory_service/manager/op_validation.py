"""Validation of a client's batch of ops, before the block manager applies any of it.

A bad op is a caller bug: it raises ``InvalidArgument`` naming the op and the problem, and because the
whole batch is checked first, nothing of the batch has been applied. Token ids are checked by
encoding them (``token_encoding``: one pass in C), and the encodings are handed on to the manager
(cache keys, token counts), with the FreeOps whose blocks must wait for the end of the batch
(``ValidatedBatch``). One check method per op type reads and updates the batch's running state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pagedserve.errors import InvalidArgument, echo

from memory_service.manager.block_types import AllocateOp, AppendOp, ForkOp, FreeOp, Op
from memory_service.token_encoding import TOKEN_WIDTH, encode_token_ids

# Longest namespace (model name + cache_salt) an AllocateOp may carry. The cache keeps a digest
# of it, not the string, but a bound keeps each op's cost (and what a sequence keeps) small.
MAX_NAMESPACE_LENGTH = 1024


class _LiveSequence(Protocol):
    num_tokens: int


def _where(index: int, op: object) -> str:
    return f"ops[{index}] ({type(op).__name__})"


def _encode_token_ids(index: int, op: object, name: str, token_ids: object) -> bytes:
    """Returns the encoded ids; raises unless ``token_ids`` is a non-empty sequence of ints in [0, 2**32)."""
    # bytes and str would be taken as raw machine words and characters. (A list is the common case.)
    if type(token_ids) is not list and isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument(
            f"{_where(index, op)}: {name} must be a sequence of int token ids, got {type(token_ids).__name__}"
        )
    try:
        token_bytes = encode_token_ids(token_ids)
    except OverflowError as exc:
        raise InvalidArgument(f"{_where(index, op)}: {name} holds a token id < 0 or >= 2**32 ({exc})") from exc
    except TypeError as exc:
        raise InvalidArgument(f"{_where(index, op)}: {name} must be a sequence of int token ids ({exc})") from exc
    if not token_bytes:
        raise InvalidArgument(f"{_where(index, op)}: {name} is empty")
    return token_bytes


class ValidatedBatch(NamedTuple):
    """What validation learned about a batch, for the block manager to apply it.

    Args:
        encoded_token_ids: per op, its token ids encoded by ``encode_token_ids`` (AllocateOp: the
            prompt; AppendOp: the new tokens); None for FreeOp and ForkOp.
        late_free_indices: indices of the FreeOps whose sequence an earlier op of the batch allocated
            or appended to (counted whether or not that op will find its blocks).
    """

    encoded_token_ids: list[bytes | None]
    late_free_indices: set[int]


@dataclass(slots=True)
class _Batch:
    """The state of the batch as its ops so far would leave it (what the per-op checks read)."""

    seqs: Mapping[str, _LiveSequence]  # the client's live sequences before the batch
    client_id: str
    # Sequences touched by earlier ops of the batch: seq_id -> a lower bound of its num_tokens (how
    # much an AllocateOp gets from the prefix cache is known only when it runs), or None once freed.
    num_tokens: dict[str, int | None] = field(default_factory=dict)
    pending_seq_ids: set[str] = field(default_factory=set)  # with tokens whose K/V this batch writes
    # Sequences that, through a ForkOp of this batch, share blocks that may hold pending tokens.
    unwritten_shared_seq_ids: set[str] = field(default_factory=set)
    late_free_indices: set[int] = field(default_factory=set)
    encoded: list[bytes | None] = field(default_factory=list)


class OpValidator:
    """Checks a batch of ops against the state as the batch itself would evolve it.

    Sequence ids are scoped per client: a client names only its own sequences, and an id that
    another client uses is, to this client, simply not live (nothing tells whether it exists).

    Args:
        max_num_tokens: token capacity of the whole pool; no sequence can ever outgrow it.
        client_seqs: the block manager's clients (read, never changed): client_id -> its live
            sequences (seq_id -> sequence).
        is_parked: ``is_parked(client_id, seq_id)``: the client's AllocateOp of that id was answered
            ``loading`` and has not got blocks since (``TierBook.is_parked``): a FreeOp of it is
            valid though no such sequence is live. None: no tier, nothing is ever parked.
    """

    def __init__(self, max_num_tokens: int, client_seqs: Mapping[str, Mapping[str, _LiveSequence]],
                 is_parked: Callable[[str, str], bool] | None = None) -> None:
        self._max_num_tokens = max_num_tokens
        self._client_seqs = client_seqs
        self._is_parked = is_parked
        self._checks: dict[type, Callable[[_Batch, int, Op], None]] = {
            AppendOp: self._check_append,
            AllocateOp: self._check_allocate,
            FreeOp: self._check_free,
            ForkOp: self._check_fork,
        }

    def validate(self, client_id: str, ops: Sequence[Op], expected_type: type | None = None) -> ValidatedBatch:
        """Raises ``InvalidArgument`` for the first bad op. Changes nothing.

        Checked: the client is attached; each op is one of the four op types (``expected_type``
        when given); seq ids are non-empty strings; new ones are not live, the others are live
        sequences of this client (counting creations and frees earlier in the batch), or, for a
        FreeOp, parked on a tier load (``is_parked``); token lists
        are non-empty with ids in [0, 2**32); ``max_num_new_tokens >= 1``; namespaces are strings of
        at most ``MAX_NAMESPACE_LENGTH`` characters; no sequence outgrows the pool; no AppendOp goes
        to a sequence that shares blocks, through a ForkOp earlier in the batch, with a sequence
        that an earlier op of the batch allocated or appended to.

        Why the last rule: copy-on-write copies a block when the op applies, but the K/V of the
        batch's new tokens is written after the whole batch (by the model's forward pass). Such an
        append could copy a shared block before those tokens are in it. Fork first, then append
        (the compute service's step does: forks, frees, then the work), or append in a later batch.

        Args:
            client_id: the client sending the batch.
            ops: the batch.
            expected_type: the only op type allowed (the single-op methods).

        Returns:
            The encoded token ids of each op, and which FreeOps free a sequence with tokens whose
            K/V this batch writes (the block manager releases those blocks after the batch).
        """
        seqs = self._client_seqs.get(client_id)
        if seqs is None:
            raise InvalidArgument(f"client_id {echo(client_id)} is not attached")
        batch = _Batch(seqs, client_id)
        checks = self._checks
        for index, op in enumerate(ops):
            op_type = type(op)
            if expected_type is not None and op_type is not expected_type:
                raise InvalidArgument(f"expected an {expected_type.__name__}, got {op_type.__name__}")
            check = checks.get(op_type)
            if check is None:
                raise InvalidArgument(
                    f"ops[{index}]: expected an AllocateOp, AppendOp, FreeOp or ForkOp, got {op_type.__name__}"
                )
            check(batch, index, op)
        return ValidatedBatch(batch.encoded, batch.late_free_indices)

    # --- one check per op type; each appends the op's encoded tokens (or None) to batch.encoded ----

    def _check_append(self, batch: _Batch, index: int, op: AppendOp) -> None:
        seq_id = op.seq_id
        seq = batch.seqs.get(seq_id) if type(seq_id) is str and seq_id not in batch.num_tokens else None
        if seq is not None:  # the common case (decode), inlined
            num_tokens = seq.num_tokens
        else:
            num_tokens = self._live_num_tokens(batch, index, op, "seq_id", seq_id)
        if seq_id in batch.unwritten_shared_seq_ids:
            raise InvalidArgument(
                f"{_where(index, op)}: seq_id {echo(seq_id)} shares blocks (by a ForkOp earlier in this batch) "
                "holding tokens whose K/V this batch has not written yet, so copy-on-write could copy them "
                "without it; fork before the AllocateOp/AppendOp, or append in a later batch"
            )
        token_bytes = _encode_token_ids(index, op, "token_ids", op.token_ids)
        num_tokens += len(token_bytes) // TOKEN_WIDTH
        if num_tokens > self._max_num_tokens:
            raise InvalidArgument(
                f"{_where(index, op)}: seq_id {echo(seq_id)} would grow to {num_tokens} tokens, "
                f"more than the whole pool holds ({self._max_num_tokens})"
            )
        batch.num_tokens[seq_id] = num_tokens
        batch.pending_seq_ids.add(seq_id)
        batch.encoded.append(token_bytes)

    def _check_allocate(self, batch: _Batch, index: int, op: AllocateOp) -> None:
        self._check_new_seq_id(batch, index, op, "seq_id", op.seq_id)
        token_bytes = _encode_token_ids(index, op, "prompt_token_ids", op.prompt_token_ids)
        num_prompt_tokens = len(token_bytes) // TOKEN_WIDTH
        if num_prompt_tokens > self._max_num_tokens:
            raise InvalidArgument(
                f"{_where(index, op)}: prompt_token_ids has {num_prompt_tokens} tokens, "
                f"more than the whole pool holds ({self._max_num_tokens})"
            )
        if type(op.max_num_new_tokens) is not int or op.max_num_new_tokens < 1:
            raise InvalidArgument(
                f"{_where(index, op)}: max_num_new_tokens must be an int >= 1, got {echo(op.max_num_new_tokens)}"
            )
        if type(op.priority) is not int:
            raise InvalidArgument(f"{_where(index, op)}: priority must be an int, got {echo(op.priority)}")
        if type(op.namespace) is not str:
            raise InvalidArgument(f"{_where(index, op)}: namespace must be a string, got {echo(op.namespace)}")
        if len(op.namespace) > MAX_NAMESPACE_LENGTH:
            raise InvalidArgument(
                f"{_where(index, op)}: namespace has {len(op.namespace)} characters, "
                f"at most {MAX_NAMESPACE_LENGTH} (hash a long cache_salt)"
            )
        batch.num_tokens[op.seq_id] = min(num_prompt_tokens, op.max_num_new_tokens)
        batch.pending_seq_ids.add(op.seq_id)
        batch.encoded.append(token_bytes)

    def _check_free(self, batch: _Batch, index: int, op: FreeOp) -> None:
        seq_id = op.seq_id
        if (self._is_parked is not None and type(seq_id) is str and seq_id not in batch.num_tokens
                and seq_id not in batch.seqs and self._is_parked(batch.client_id, seq_id)):
            # Parked on a tier load, dropped by its client: it holds no blocks, the tier forgets it.
            batch.num_tokens[seq_id] = None
            batch.encoded.append(None)
            return
        self._live_num_tokens(batch, index, op, "seq_id", seq_id)
        batch.num_tokens[op.seq_id] = None
        # Tokens it got in this batch have their K/V written after the batch: its blocks must
        # outlive the batch. (Its forks share only blocks it holds: freeing them needs no delay.)
        if op.seq_id in batch.pending_seq_ids:
            batch.late_free_indices.add(index)
            batch.pending_seq_ids.remove(op.seq_id)
        batch.unwritten_shared_seq_ids.discard(op.seq_id)
        batch.encoded.append(None)

    def _check_fork(self, batch: _Batch, index: int, op: ForkOp) -> None:
        num_tokens = self._live_num_tokens(batch, index, op, "parent_seq_id", op.parent_seq_id)
        self._check_new_seq_id(batch, index, op, "child_seq_id", op.child_seq_id)
        if op.parent_seq_id in batch.pending_seq_ids or op.parent_seq_id in batch.unwritten_shared_seq_ids:
            batch.unwritten_shared_seq_ids.update((op.parent_seq_id, op.child_seq_id))
        batch.num_tokens[op.child_seq_id] = num_tokens
        batch.encoded.append(None)

    # --- shared checks ---------------------------------------------------------------------------

    @staticmethod
    def _live_num_tokens(batch: _Batch, index: int, op: Op, name: str, seq_id: object) -> int:
        if type(seq_id) is not str:
            raise InvalidArgument(f"{_where(index, op)}: {name} must be a string, got {echo(seq_id)}")
        if seq_id in batch.num_tokens:
            num_tokens = batch.num_tokens[seq_id]
            if num_tokens is None:
                raise InvalidArgument(
                    f"{_where(index, op)}: {name} {echo(seq_id)} was freed by an earlier op of this batch")
            return num_tokens
        seq = batch.seqs.get(seq_id)
        if seq is None:
            # The same words whether the id is unknown or another client's: ids are per client.
            raise InvalidArgument(f"{_where(index, op)}: {name} {echo(seq_id)} is not a live sequence of this client")
        return seq.num_tokens

    @staticmethod
    def _check_new_seq_id(batch: _Batch, index: int, op: Op, name: str, seq_id: object) -> None:
        if type(seq_id) is not str or not seq_id:
            raise InvalidArgument(f"{_where(index, op)}: {name} must be a non-empty string, got {echo(seq_id)}")
        is_live = batch.num_tokens[seq_id] is not None if seq_id in batch.num_tokens else seq_id in batch.seqs
        if is_live:
            raise InvalidArgument(
                f"{_where(index, op)}: {name} {echo(seq_id)} is already a live sequence of this client")
