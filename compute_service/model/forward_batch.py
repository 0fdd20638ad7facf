"""The inputs of one model step: a packed, variable-length batch of new tokens, without padding.

B sequences contribute q_len_b >= 1 new tokens each (a whole prompt, a prompt chunk on top of
cached context, or one decode token); the T = sum(q_len_b) tokens are concatenated. Every index
tensor refers to the KV pool layout of docs/design.md.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """One step's new tokens and where their context lives in the KV pool.

    Attributes:
        input_ids: (T,) int64 token ids, sequence after sequence.
        positions: (T,) int64 absolute position of each token in its sequence.
        slot_mapping: (T,) int32/int64 pool slot the token's K/V is written to
            (`block_id * block_size + offset`); -1 skips the write.
        block_tables: (B, max_blocks) int32 physical block of each logical block, 0-padded.
        seq_lens: (B,) int32 context length of each sequence INCLUDING its new tokens.
        cu_seqlens_q: (B + 1,) int32 new tokens of sequence b are rows cu[b]:cu[b + 1].
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor

    def __post_init__(self) -> None:
        # Shapes only: reading values would synchronise a CUDA device on every step.
        num_tokens = self.input_ids.shape[0] if self.input_ids.dim() == 1 else -1
        for field in ("input_ids", "positions", "slot_mapping"):
            tensor = getattr(self, field)
            if tensor.dim() != 1 or tensor.shape[0] != num_tokens:
                raise ValueError(f"{field} must be (T,) with T = len(input_ids), got {tuple(tensor.shape)}")
        if num_tokens == 0:
            raise ValueError("a forward batch needs at least one token")
        if self.block_tables.dim() != 2:
            raise ValueError(f"block_tables must be (B, max_blocks), got {tuple(self.block_tables.shape)}")
        num_seqs = self.block_tables.shape[0]
        if tuple(self.seq_lens.shape) != (num_seqs,):
            raise ValueError(f"seq_lens must be (B,) = ({num_seqs},), got {tuple(self.seq_lens.shape)}")
        if tuple(self.cu_seqlens_q.shape) != (num_seqs + 1,):
            raise ValueError(
                f"cu_seqlens_q must be (B + 1,) = ({num_seqs + 1},), got {tuple(self.cu_seqlens_q.shape)}"
            )
        for field in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q"):
            tensor = getattr(self, field)
            if tensor.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{field} must be int32 or int64, got {tensor.dtype}")
            if tensor.device != self.input_ids.device:
                raise ValueError(f"{field} is on {tensor.device}, input_ids on {self.input_ids.device}")

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens."""
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences."""
        return self.block_tables.shape[0]

    @classmethod
    def build(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        num_computed_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build a batch on the host and move it to `device` in one copy per tensor.

        Args:
            new_token_ids: per sequence, the tokens to run this step (at least one each).
            num_computed_tokens: per sequence, how many tokens before them already have K/V in the
                pool (cached prefix, earlier chunks, earlier decode steps).
            block_tables: per sequence, its physical block ids, covering every new token.
            block_size: tokens per block of the pool.
            device: where the model runs.
        Raises:
            ValueError: mismatched lengths, an empty sequence, or a block table too short.
        """
        if not (len(new_token_ids) == len(num_computed_tokens) == len(block_tables)):
            raise ValueError(
                f"got {len(new_token_ids)} token lists, {len(num_computed_tokens)} computed counts "
                f"and {len(block_tables)} block tables; need one of each per sequence"
            )
        if not new_token_ids:
            raise ValueError("a forward batch needs at least one sequence")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        # Host arrays filled by C loops (array.extend) and three tensors over their memory: the
        # step's cost is a few Python operations per sequence, per block of a prompt, never per
        # token. (A per-token loop and torch.tensor calls on nested lists cost tens of ns an
        # element; numpy's many small calls lose to this once the model's pass has evicted them
        # from the caches.)
        num_seqs = len(new_token_ids)
        longs = array("q")  # input_ids | positions | slot_mapping, T each
        positions, slots = array("q"), array("q")
        ints = array("i", [0] * (2 * num_seqs + 1))  # seq_lens (B) | cu_seqlens_q (B + 1)
        max_blocks = max(len(table) for table in block_tables)
        tables = array("i")
        num_tokens = 0
        for b, (tokens, start, table) in enumerate(zip(new_token_ids, num_computed_tokens, block_tables)):
            num_new = len(tokens)
            seq_len = start + num_new
            if not num_new or start < 0:
                raise ValueError(f"sequence {b}: needs >= 1 new token and computed >= 0, got {num_new}, {start}")
            if len(table) * block_size < seq_len:
                raise ValueError(f"sequence {b}: {len(table)} blocks cannot hold {seq_len} tokens")
            longs.extend(tokens)
            if num_new == 1:  # a decode
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                positions.extend(range(start, seq_len))
                position = start
                while position < seq_len:  # one run of slots per block
                    end = min(seq_len, (position // block_size + 1) * block_size)
                    first = table[position // block_size] * block_size + position % block_size
                    slots.extend(range(first, first + end - position))
                    position = end
            tables.extend(table)
            if len(table) < max_blocks:
                tables.extend(_zeros(max_blocks - len(table)))
            num_tokens += num_new
            ints[b] = seq_len
            ints[num_seqs + b + 1] = num_tokens
        longs.extend(positions)
        longs.extend(slots)
        flat = torch.frombuffer(longs, dtype=torch.int64).to(device)
        flat_ints = torch.frombuffer(ints, dtype=torch.int32).to(device)
        return cls(
            input_ids=flat[:num_tokens],
            positions=flat[num_tokens : 2 * num_tokens],
            slot_mapping=flat[2 * num_tokens :],
            block_tables=torch.frombuffer(tables, dtype=torch.int32).view(num_seqs, max_blocks).to(device),
            seq_lens=flat_ints[:num_seqs],
            cu_seqlens_q=flat_ints[num_seqs:],
        )


@functools.lru_cache(maxsize=64)
def _zeros(n: int) -> array:
    """``n`` int32 zeros, block-table padding (shared: ``array.extend`` copies them)."""
    return array("i", bytes(4 * n))
