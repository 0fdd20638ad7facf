"""Prefix caching switched off where the cache lives: a memory service started with
``--enable-prefix-caching false`` serves the compute service no cached prompt tokens, over the wire,
while the default (on) serves the repeated prompt's full blocks from the cache. The serving
benchmark's "without prefix caching" stack relies on this switch."""

from __future__ import annotations

import pytest

from pagedserve_testing.tiny_model import ServiceModel
from tests.compute_service.service_fixtures import BLOCK_SIZE, running_services

PROMPT = list(range(40, 40 + 4 * BLOCK_SIZE + 3))  # 4 full blocks and a partial one


@pytest.mark.parametrize(("flag", "expected_cached"), [("true", 4 * BLOCK_SIZE), ("false", 0)])
def test_second_request_reports_cached_tokens_only_with_prefix_caching(
        service_model: ServiceModel, flag: str, expected_cached: int) -> None:
    memory_args = ("--max-num-blocks", "64", "--enable-prefix-caching", flag)
    with running_services(service_model.path, memory_args=memory_args) as services:
        first = services.generate(PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True)
        second = services.generate(PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True)
        assert first[-1].usage.cached_prompt_tokens == 0
        assert second[-1].usage.cached_prompt_tokens == expected_cached
        # Same greedy tokens either way: the cache changes where K/V comes from, not the result.
        assert [t for m in second for t in m.token_ids] == [t for m in first for t in m.token_ids]
        stats = services.wait_released()
        assert (stats.prefix_cache_hits > 0) == (flag == "true")
