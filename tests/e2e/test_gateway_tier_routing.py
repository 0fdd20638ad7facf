"""Prefix affinity to a KV tier, end to end: real memory, compute and gateway
processes with the tiny random model.

Two engine pods, each with a memory service of its own; only one has a disk tier. A prompt routed to
that one and then evicted from its small pool is still in its tier: the gateway predicts a tier hit
there (its model of that pool dropped the prompt's blocks, its model of the tier kept them) and none
on the other backend, so the prompt goes back to the tier's backend, which loads the blocks and
reports them as cached prompt tokens. Then that memory service restarts on its directory (the same id,
a new epoch): the gateway's prediction of its pool becomes a prediction of its tier. Asserted
through the routing metric, the reply's usage and the memory service's tier counters, never timing.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.stack import Stack, StackConfig, shm_segments
from pagedserve_testing.stack import memory_stats, start_gateway
from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.test_gateway_shared_cache import _decisions

BLOCK = 16
# Byte tokens: 100 tokens, 6 full blocks the pool (and the tier) can cache.
PROMPT = "Remember this: the tier keeps what the pool forgets, and routing finds it. " + "x" * 25
POOL_BLOCKS = 16  # a 160-token prompt and its answer take 11 of them


def _generate(gateway, prompt: str) -> gateway_pb2.GenerateResponse:
    params = gateway_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    return gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=params), timeout=60)


def test_a_prompt_evicted_to_one_backends_tier_is_routed_back_there(service_model: ServiceModel,
                                                                      tmp_path: Path) -> None:
    assert len(PROMPT) == 100
    os.chmod(tmp_path, 0o700)
    compute_args = ("--dtype", "float32", "--block-size", str(BLOCK), "--max-num-seqs", "4",
                    "--memory-retry-interval-s", "0.2")

    def stack(name: str, *memory_args: str) -> Stack:
        return Stack(StackConfig(model=str(service_model.path), name=name, ready_timeout_s=120,
                                 memory_args=("--block-size", str(BLOCK), "--log-level", "warning", *memory_args),
                                 compute_args=compute_args), tmp_path)

    tiered = stack("tiered-", "--max-num-blocks", str(POOL_BLOCKS), "--kv-disk-dir", str(tmp_path / "tier"))
    plain = stack("plain-", "--max-num-blocks", "64")
    started: list[Stack] = [tiered, plain]
    gateway = None
    pool = ThreadPoolExecutor(2)
    try:
        tiered.spawn_memory()
        # The plain backend's compute service loads its model now, but its memory service starts
        # only later: until then it is NOT_SERVING, out of the gateway's rotation.
        plain.spawn_compute()
        tiered.spawn_compute()
        # The gateway starts beside them (its imports overlap the model loads); it is SERVING once
        # the tiered backend is in rotation.
        starting_gateway = pool.submit(start_gateway, [tiered.compute_address, plain.compute_address], tmp_path)
        try:
            for service in (tiered.memory, tiered.compute):
                service.wait_ready(120)
        finally:
            gateway = starting_gateway.result()
        assert gateway.num_healthy_backends() == 1

        first = _generate(gateway, PROMPT)  # the only backend in rotation: the tiered one
        assert first.usage.cached_prompt_tokens == 0
        tiered_memory = tiered.memory.address
        wait_until(lambda: memory_stats(tiered_memory).tiers[0].num_blocks >= 6, 30, "the prompt written behind")
        for filler in "ab":  # 10 blocks each: the prompt's 6 leave the pool (and the gateway's model of it)
            _generate(gateway, f"{filler} " * 80)
        plain.spawn_memory().wait_ready(120)
        plain.compute.wait_ready(120)
        wait_until(lambda: gateway.num_healthy_backends() == 2, 30, "both backends in rotation")

        before = _decisions(gateway)
        again = _generate(gateway, PROMPT)
        gained = _decisions(gateway) - before
        assert gained == {(tiered.compute_address, "tier"): 1}
        assert again.usage.cached_prompt_tokens == 96  # loaded from the tier
        assert again.choices[0].token_ids == first.choices[0].token_ids
        tier = memory_stats(tiered_memory).tiers[0]
        assert (tier.num_hits, tier.num_loads) == (6, 1)

        # The tiered memory service restarts on its directory: the same id, a new epoch, an empty
        # pool. The gateway's model of that pool held the prompt (just routed there): a tier hit now.
        tiered.restart_memory()
        wait_until(lambda: "memory_service_restarted" in gateway.log_file.read_text(), 30,
                   "the gateway noticed the restart")
        wait_until(lambda: gateway.num_healthy_backends() == 2, 30, "both backends in rotation")
        before = _decisions(gateway)
        warm = _generate(gateway, PROMPT)
        assert _decisions(gateway) - before == {(tiered.compute_address, "tier"): 1}
        assert warm.usage.cached_prompt_tokens == 96 and warm.choices[0].token_ids == first.choices[0].token_ids
        assert memory_stats(tiered.memory.address).tiers[-1].num_loads == 1  # the new service's
    finally:
        if gateway is not None:
            assert gateway.stop() == 0
        memory_pids = [s.memory.pid if s.memory is not None else None for s in started]
        for statuses in pool.map(Stack.stop, started):  # both stacks at once
            assert all(status == 0 for status in statuses.values())
        pool.shutdown()
        assert all(pid is None or not shm_segments(pid) for pid in memory_pids)
    assert not list(tmp_path.glob("*.sock")), "a service left its socket behind"
