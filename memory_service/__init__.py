"""pagedserve memory service: owns the KV pool and every block's metadata (see docs/design.md)."""
