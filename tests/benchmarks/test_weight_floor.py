"""The weight-read floor's byte count: what one decode step reads, from the safetensors headers."""

from __future__ import annotations

from pathlib import Path

from benchmarks.throughput.weight_floor import weight_bytes
from pagedserve_testing.tiny_model import build_service_model


def test_untied_model_reads_lm_head_not_the_embedding(tmp_path: Path) -> None:
    model = build_service_model(tmp_path / "model")  # untied: embed_tokens and lm_head, 258 x 64 each
    counts = weight_bytes(model.path, 2)
    layer = 4 * 64 * 64 // 2 + 2 * (64 * 64 // 2) + 3 * 64 * 128 + 2 * 64  # q, o; k, v (2 of 4 heads); mlp; norms
    assert not counts["tied_embeddings"]
    assert counts["params"] == 2 * 258 * 64 + 2 * layer + 64  # + the final norm
    assert counts["params_read_per_step"] == counts["params"] - 258 * 64
    assert counts["bytes_read_per_step"] == 2 * counts["params_read_per_step"]
