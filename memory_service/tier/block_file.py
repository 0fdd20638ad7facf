"""What every tier and the disk tier's files agree on: a block's identity and the block file's header.

``TierIdentity`` is the model and layout a tier keeps blocks of; every tier reads it (``tier.py``'s
Protocols name it), and its digest salts the chained block keys. Its sizes follow the disk tier's
file format (``disk_tier.py``'s docstring): the payload's offset past the header, the layout version
hashed into the digest. So the header's constants live here, below both ``tier.py`` and
``disk_tier.py``: the tier Protocols need the identity, the disk tier needs the Protocols' types,
and neither module has to import the other's dependent (the imports go one way:
``disk_tier`` -> ``tier`` -> ``block_file``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from pagedserve.dtypes import ELEMENT_SIZES

from memory_service.manager.chain import HASH_SIZE
from memory_service.token_encoding import TOKEN_WIDTH

MAGIC = b"PSKVBLK\x01"
LAYOUT_VERSION = 3  # 1: CRC-32 checksums, the payload right after the header; 2: no origin
# magic, layout version, payload offset, dtype, block size, layers, KV heads, head dim, fingerprint
# digest, namespace key, block key, payload length, payload XXH3-64; then the header's own XXH3-64.
HEADER_FIELDS = struct.Struct("<8sHH16sIIII32s16s32sQQ")
HEADER_CHECKSUM = struct.Struct("<Q")
HEADER_SIZE = HEADER_FIELDS.size + HEADER_CHECKSUM.size
# Where an O_DIRECT write's buffer, offsets and length must fall (the page size: above every logical
# block size in use).
DIRECT_ALIGN = 4096
NAMESPACE_KEY_SIZE = 16  # the header's namespace key field


@dataclass(frozen=True)
class TierIdentity:
    """What a tier block's bytes depend on besides its tokens: the model and the pool's layout.

    Args:
        fingerprint: the model weights' fingerprint, as the client sent it at Attach.
        dtype, block_size, num_layers, num_kv_heads, head_dim: the pool's layout (KvLayout).
    """

    fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def fingerprint_digest(self) -> bytes:
        return hashlib.blake2b(self.fingerprint.encode(), digest_size=32).digest()

    @property
    def digest(self) -> bytes:
        """Every field and the layout version, hashed: the salt of the chained block keys."""
        fields = (LAYOUT_VERSION, self.fingerprint, self.dtype, self.block_size, self.num_layers,
                  self.num_kv_heads, self.head_dim)
        return hashlib.blake2b(repr(fields).encode(), digest_size=32).digest()

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, 2, block_size, num_kv_heads, head_dim): one block of the pool."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        elem = ELEMENT_SIZES[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def origin_size(self) -> int:
        """A file's ``BlockOrigin``, right after the header: the parent's key and the block's tokens."""
        return HASH_SIZE + self.block_size * TOKEN_WIDTH

    @property
    def payload_offset(self) -> int:
        """Where a file's payload begins: on a page boundary past the header and the origin when its
        bytes are whole pages (``O_DIRECT``), else right after the origin."""
        end = HEADER_SIZE + self.origin_size
        return -(-end // DIRECT_ALIGN) * DIRECT_ALIGN if self.bytes_per_block % DIRECT_ALIGN == 0 else end

    @property
    def file_size(self) -> int:
        return self.payload_offset + self.bytes_per_block
