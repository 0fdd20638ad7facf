"""Token ids as bytes: how the block manager validates them and keys the prefix cache.

Token ids are unsigned 32-bit: an id that does not fit (negative, >= 2**32, not an int) cannot be
encoded, which is how a whole op's token list is validated in one pass in C. The encoding is used
with prefix caching off too (validation, and the token counts the manager keeps), so it lives
apart from ``prefix_cache``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_TOKEN_TYPECODE = "I"
TOKEN_WIDTH = array(_TOKEN_TYPECODE).itemsize  # bytes per token id


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Encodes token ids, ``TOKEN_WIDTH`` bytes each.

    Args:
        token_ids: ints in ``[0, 2**32)``.

    Returns:
        ``TOKEN_WIDTH`` bytes per token.

    Raises:
        OverflowError: an id is negative or too large.
        TypeError: an id is not an int.
    """
    return array(_TOKEN_TYPECODE, token_ids).tobytes()


def decode_token_ids(token_bytes: bytes) -> list[int]:
    """Inverse of ``encode_token_ids`` (debugging and tests)."""
    token_ids = array(_TOKEN_TYPECODE)
    token_ids.frombytes(token_bytes)
    return token_ids.tolist()
