"""The shared request rules: block counts, reply estimates and the wire limit, exactly."""

from __future__ import annotations

import pytest

from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument

pytestmark = pytest.mark.unit


def test_kv_blocks_needed_shares_the_prompts_full_blocks() -> None:
    # 10-token prompt, blocks of 4: 2 full blocks shared; each completion copies the partial one
    # (2 tokens) and adds 700 tokens: ceil(702 / 4) = 176 blocks of its own.
    assert rules.kv_blocks_needed(10, 700, 1, 4) == 2 + 176 == -(-(10 + 700) // 4)
    assert rules.kv_blocks_needed(10, 700, 2, 4) == 2 + 2 * 176
    assert rules.kv_blocks_needed(8, 4, 3, 4) == 2 + 3 * 1


def test_capacity_counts_every_completion() -> None:
    rules.check_capacity(10, 700, 1, 4, 300)
    rules.check_capacity(10, 500, 2, 4, 300)  # 2 + 2 x 126 = 254
    with pytest.raises(InvalidArgument, match=r"^params.n: 2 completions .* need 354 blocks"):
        rules.check_capacity(10, 700, 2, 4, 300)
    with pytest.raises(InvalidArgument, match=r"^params.max_tokens: .* KV pool's 1200 tokens"):
        rules.check_capacity(10, 1191, 1, 4, 300)


def test_reply_bound_refuses_only_what_cannot_be_sent() -> None:
    # At least 1 + 2 + 22 + 82 = 107 bytes per token with logprobs=20 (a lower bound).
    assert rules.min_reply_bytes(1, 1, 20) == 107 and rules.min_reply_bytes(3, 10, None) == 30
    with pytest.raises(InvalidArgument, match="use GenerateStream"):
        rules.check_reply_fits(64, 900, 20, 4 << 20)  # 6.2 MB at the least
    rules.check_reply_fits(40, 900, 20, 4 << 20)  # 3.9 MB at the least: might fit, so not refused
    rules.check_reply_fits(1, 4096, None, 4 << 20)  # a long plain answer


def test_counts_are_checked_before_contents() -> None:
    with pytest.raises(InvalidArgument, match=r"^params.stop_token_ids: at most 1024 ids, got 1025$"):
        rules.check_counts(0, 1025)
    with pytest.raises(InvalidArgument, match=r"^params.stop: at most 16 strings, got 17$"):
        rules.check_counts(17, 0)
    # A prompt over the model's length is named for its length, whatever its ids hold.
    with pytest.raises(InvalidArgument, match=r"^prompt_token_ids: at most 1024 tokens"):
        rules.check_prompt_length(16_000_000, 1, 1024)
    with pytest.raises(InvalidArgument, match=r"^prompt_token_ids\[2\] must be in \[0, 10\), got 10$"):
        rules.check_token_ids("prompt_token_ids", [1, 2, 10, -1], 10)


def test_wire_limit_is_sized_from_the_request_limits() -> None:
    size = rules.max_message_bytes()
    assert rules.MAX_PROMPT_TOKENS * 5 < size < 8 << 20  # far below the old flat 64 MiB
    assert rules.max_message_bytes(1024) < rules.max_message_bytes()
