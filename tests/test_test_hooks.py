"""The test hooks: one environment entry, read by each service's ``__main__`` and nowhere else;
in-process tests give the engine its double directly."""

from __future__ import annotations

import pytest

import compute_service.__main__ as compute_main
import memory_service.__main__ as memory_main
from compute_service import SamplingParams
from compute_service.engine.faults import DetokenizeFault
from compute_service.engine.outputs import RequestOutput, collect
from pagedserve.test_hooks import TEST_HOOKS_ENV, ServiceHooks, encode_test_hooks, read_test_hooks

from tests.compute_service.tiny_llama import build_tiny_llama, in_process_engine, to_causal_lm

pytestmark = pytest.mark.unit

POISON = [31, 32, 201, 202, 203]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return to_causal_lm(build_tiny_llama(seed=0))


def run(engine, prompts: dict[str, list[int]]) -> dict[str, RequestOutput]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, PARAMS)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        collect(results, engine.step())
    return results


def test_hooks_are_read_from_one_entry() -> None:
    assert read_test_hooks({}) == ServiceHooks()
    value = encode_test_hooks(pool_creation_delay_s=3, detokenize_fault=[{"prompt_suffix": [1], "after_tokens": 2}])
    hooks = read_test_hooks({TEST_HOOKS_ENV: value})
    assert hooks.pool_creation_delay_s == 3 and hooks.detokenize_fault == [{"prompt_suffix": [1], "after_tokens": 2}]
    assert DetokenizeFault.from_entries(hooks.detokenize_fault) == DetokenizeFault({(1,): 2})
    assert DetokenizeFault.from_entries([]) is None


@pytest.mark.parametrize(("value", "match"), [
    ("{", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"pool_creation_delay": 3}', r"unknown key\(s\) \['pool_creation_delay'\]"),
    ('{"pool_creation_delay_s": -1}', "pool_creation_delay_s must be a number >= 0"),
    ('{"detokenize_fault": {}}', "detokenize_fault must be a list"),
])
def test_bad_hooks_are_refused_naming_what_is_wrong(value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_test_hooks({TEST_HOOKS_ENV: value})


def test_each_service_refuses_bad_hooks_at_start(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(TEST_HOOKS_ENV, '{"nonsense": 1}')
    assert memory_main.main([]) == 2
    assert compute_main.main([]) == 2  # before any model loads
    assert capsys.readouterr().err.count("unknown key(s) ['nonsense']") == 2


def test_an_engine_reads_no_environment(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: every Engine read PAGEDSERVE_TEST_FAULT_DETOKENIZE when built, deep in production code."""
    fault = encode_test_hooks(detokenize_fault=[{"prompt_suffix": POISON[-3:], "after_tokens": 2}])
    monkeypatch.setenv(TEST_HOOKS_ENV, fault)
    monkeypatch.setenv("PAGEDSERVE_TEST_FAULT_DETOKENIZE", '[{"prompt_suffix": [201, 202, 203], "after_tokens": 2}]')
    results = run(in_process_engine(*tiny), {"poison": POISON})
    assert results["poison"].outputs[0].finish_reason == "length"


def test_an_injected_fault_ends_its_request_alone(tiny) -> None:
    engine = in_process_engine(*tiny)
    engine.detokenize_fault = DetokenizeFault({tuple(POISON[-3:]): 2})  # the in-process double
    results = run(engine, {"good": [11, 12, 13, 14], "poison": POISON})
    assert [o.finish_reason for o in (results["good"], results["poison"])] == ["length", "error"]
    assert len(results["good"].token_ids) == 6 and len(results["poison"].token_ids) == 2
    assert results["poison"].error == "postprocessing failed (InjectedFault)"
    assert engine.num_failed_requests == 1 and engine.memory.stats().num_sequences == 0
