"""The inputs of one model step: a packed, variable-length batch of new tokens, without padding.

B sequences contribute q_len_b >= 1 new tokens each (a whole prompt, a prompt chunk on top of
cached context, or one decode token); the T = sum(q_len_b) tokens are concatenated. Every index
tensor refers to the KV pool layout of docs/design.md.
"""

from __future__ import annotations

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
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu_seqlens = [0]
        for b, (tokens, start, table) in enumerate(zip(new_token_ids, num_computed_tokens, block_tables)):
            seq_len = start + len(tokens)
            if not tokens or start < 0:
                raise ValueError(f"sequence {b}: needs >= 1 new token and computed >= 0, got {len(tokens)}, {start}")
            if len(table) * block_size < seq_len:
                raise ValueError(f"sequence {b}: {len(table)} blocks cannot hold {seq_len} tokens")
            input_ids.extend(tokens)
            positions.extend(range(start, seq_len))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, seq_len))
            seq_lens.append(seq_len)
            cu_seqlens.append(cu_seqlens[-1] + len(tokens))
        max_blocks = max(len(table) for table in block_tables)
        padded = [list(table) + [0] * (max_blocks - len(table)) for table in block_tables]
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
            positions=torch.tensor(positions, dtype=torch.int64).to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
            block_tables=torch.tensor(padded, dtype=torch.int32).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32).to(device),
        )
