"""The memory service's disk tier end to end (real memory-service processes, a tiny random Llama):
a prompt evicted from the pool comes back from the disk with the same greedy tokens, counted as
cached; a new memory service on the same directory finds it (warm restart); another model's weights
under the same name find nothing and the files are removed."""

from __future__ import annotations

import os
import random
import stat
import time
from pathlib import Path

import pytest
import torch

from compute_service import LLM
from compute_service.model.fingerprint import weights_fingerprint
from compute_service.model.model_loader import load_model
from tests.compute_service.tiny_llama import build_tiny_llama, save_tiny_llama, to_causal_lm

BLOCK = 16
PROMPT_TOKENS = 100  # 6 full blocks (96 tokens) can be cached, the 100th token is always computed
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def tier_files(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(".kv")]


def wait_for_tier_blocks(llm: LLM, num_blocks: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not llm.memory_stats().tiers or llm.memory_stats().tiers[0].num_blocks < num_blocks:
        assert time.monotonic() < deadline, f"the tier holds {llm.memory_stats().tiers}"
        time.sleep(0.05)


def test_evicted_prompt_comes_back_from_disk_and_after_a_restart(tmp_path: Path) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(2, 256) for _ in range(PROMPT_TOKENS)]
    others = [[rng.randrange(2, 256) for _ in range(150)] for _ in range(2)]
    tier_dir = tmp_path / "tier"
    pool = {"max_num_blocks": 14, "block_size": BLOCK, "kv_disk_dir": str(tier_dir)}
    model_dir = save_tiny_llama(tmp_path / "a" / "tiny", seed=0)

    with LLM(str(model_dir), **pool) as llm:
        [first] = llm.generate([prompt], **GREEDY)
        assert first.num_cached_tokens == 0
        wait_for_tier_blocks(llm, 6)  # written behind while cached
        for other in others:  # 10 blocks each, of a 14-block pool: the prompt's blocks are evicted
            llm.generate([other], **GREEDY)
        [again] = llm.generate([prompt], **GREEDY)
        assert again.token_ids == first.token_ids
        assert again.num_cached_tokens == 96
        tier = llm.memory_stats().tiers[0]
        assert tier.num_loads >= 1 and tier.num_hits >= 6 and tier.num_bytes_read > 0
    assert stat.S_IMODE(os.stat(tier_dir).st_mode) == 0o700
    assert tier_files(tier_dir) and all(
        stat.S_IMODE(os.stat(tier_dir / name).st_mode) == 0o600 for name in tier_files(tier_dir))

    with LLM(str(model_dir), **pool) as llm:  # a new memory service on the same directory
        [warm] = llm.generate([prompt], **GREEDY)
        assert warm.token_ids == first.token_ids
        assert warm.num_cached_tokens == 96

    model_a_files = set(tier_files(tier_dir))
    other_weights = save_tiny_llama(tmp_path / "b" / "tiny", seed=1)  # same name, other weights
    with LLM(str(other_weights), **pool) as llm:
        [result] = llm.generate([prompt], **GREEDY)
        assert result.num_cached_tokens == 0
        assert llm.memory_stats().tiers[0].num_bad_files == len(model_a_files)
    assert not model_a_files & set(tier_files(tier_dir))  # another model's blocks: removed at open


def test_evicted_prompt_comes_back_from_the_host_tier_with_the_same_tokens(tmp_path: Path) -> None:
    """``LLM(kv_host_bytes=...)`` with no directory: the memory service's RAM tier alone gives an
    evicted prompt's blocks back as cached tokens, and greedy decoding says the same tokens."""
    rng = random.Random(11)
    prompt = [rng.randrange(2, 256) for _ in range(PROMPT_TOKENS)]
    others = [[rng.randrange(2, 256) for _ in range(150)] for _ in range(2)]
    model_dir = save_tiny_llama(tmp_path / "tiny", seed=0)
    with LLM(str(model_dir), max_num_blocks=14, block_size=BLOCK, kv_host_bytes=1 << 20) as llm:
        [first] = llm.generate([prompt], **GREEDY)
        wait_for_tier_blocks(llm, 6)
        for other in others:
            llm.generate([other], **GREEDY)
        [again] = llm.generate([prompt], **GREEDY)
        assert again.token_ids == first.token_ids
        assert again.num_cached_tokens == 96
        [host] = llm.memory_stats().tiers
        assert host.kind == "host" and host.num_loads >= 1 and host.num_hits >= 6
        assert host.num_bytes_read >= 6 * host.num_bytes // host.num_blocks


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fingerprint_does_not_follow_the_cpus_packing(make_tiny_model, monkeypatch, dtype: str) -> None:
    # Packed copies, the AMX tiles' layout and released plain weights depend on the CPU and its free
    # memory: the fingerprint (the KV tier's key across machines) is taken before any of them.
    path = str(make_tiny_model("llama").path)
    packed = load_model(path, device="cpu", dtype=dtype)
    monkeypatch.setenv("PAGEDSERVE_CPU_PREPACK", "0")
    monkeypatch.setenv("PAGEDSERVE_CPU_SMALL_LINEAR", "0")
    plain = load_model(path, device="cpu", dtype=dtype)
    assert not plain.model.is_prepacked
    assert packed.fingerprint == plain.fingerprint == weights_fingerprint(plain.model, plain.config)


def test_fingerprint_follows_the_weights() -> None:
    model, config = to_causal_lm(build_tiny_llama(seed=0))
    again, _ = to_causal_lm(build_tiny_llama(seed=0))
    other, _ = to_causal_lm(build_tiny_llama(seed=1))
    fingerprint = weights_fingerprint(model, config)
    assert len(fingerprint) == 64 and fingerprint == weights_fingerprint(again, config)
    assert weights_fingerprint(other, config) != fingerprint
    with torch.no_grad():
        model.layers[1].mlp.down_weight[0, 0] += 1.0  # one sampled element (the first of a tensor)
    assert weights_fingerprint(model, config) != fingerprint
