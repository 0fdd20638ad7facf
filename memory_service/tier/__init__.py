"""Tiers below the KV pool: where cached blocks go when the pool evicts them (``tier.py``: what a tier is)."""
