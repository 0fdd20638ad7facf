"""The block manager (pure Python, no protobuf): pool of blocks, prefix cache, LRU, op validation and apply."""
