"""What the engine hands out per step, in process on a tiny Llama:

- each step's delta carries only that step's news, so what a slow consumer queues per step does not
  grow with the length (whatever n and logprobs), and LLM.generate still returns whole results
  token for token equal to transformers;
- a failure of one request's own work (a detokenizer fault injected into that request) ends that
  request alone with finish_reason "error"; the requests beside it finish with their reference
  tokens, the engine goes on, and every block comes back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from compute_service import LLM, SamplingParams
from compute_service.engine.faults import DetokenizeFault
from compute_service.engine.outputs import RequestOutput, collect
from compute_service.service.stream_buffer import StreamBuffer
from tests.compute_service.test_engine import hf_greedy, hf_model, tiny_dir  # noqa: F401 - fixtures

POISON_SUFFIX = [201, 202, 203]  # prompts ending so fail in detokenization after 2 tokens


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> Iterator[LLM]:  # noqa: F811 - the imported fixture
    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=512) as llm:
        llm.engine.detokenize_fault = DetokenizeFault({tuple(POISON_SUFFIX): 2})  # the in-process double
        yield llm


def test_step_deltas_carry_only_the_news(llm: LLM, hf_model) -> None:  # noqa: F811
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=3, logprobs=5)
    engine = llm.engine
    engine.add_request("r", prompt, params)
    results: dict[str, RequestOutput] = {}
    sizes = []
    while engine.has_unfinished():
        deltas = engine.step()
        for delta in deltas:
            # One new token per completion and step, its logprobs alongside: nothing repeated.
            assert all(len(c.token_ids) <= 1 and len(c.logprobs) == len(c.token_ids) for c in delta.completions)
            sizes.append(sum(len(c.token_ids) + sum(len(lp.top_token_ids) for lp in c.logprobs)
                             for c in delta.completions))
        collect(results, deltas)
    assert max(sizes) == sizes[0] == 3 * (1 + 5)  # the same at the first token and the 40th
    out = results["r"]
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length"] * 3
    expected = hf_greedy(hf_model, prompt, 40)
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert [len(c.logprobs) for c in out.outputs] == [40] * 3
    assert [lp.token_id for lp in out.outputs[0].logprobs] == expected
    # LLM.generate accumulates the deltas into the same whole results.
    [again] = llm.generate([prompt], params)
    assert [c.token_ids for c in again.outputs] == [expected] * 3
    assert [[lp.top_token_ids for lp in c.logprobs] for c in again.outputs] == \
        [[lp.top_token_ids for lp in c.logprobs] for c in out.outputs]


def test_a_failing_request_ends_alone(llm: LLM, hf_model) -> None:  # noqa: F811
    good = [[11, 12, 13, 14], [21, 22, 23]]
    poison = [31, 32, *POISON_SUFFIX]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([good[0], poison, good[1]], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].token_ids == hf_greedy(hf_model, poison, 2)  # the two tokens before the fault
    assert outs[1].error == "postprocessing failed (InjectedFault)"
    assert [outs[0].token_ids, outs[2].token_ids] == [hf_greedy(hf_model, p, 12) for p in good]
    assert llm.engine.num_failed_requests == 1
    # n > 1: every completion of the failing request ends "error", nothing else is touched.
    [forked, fine] = llm.generate([poison, good[0]], SamplingParams(max_tokens=6, temperature=0.0,
                                                                     ignore_eos=True, n=3))
    assert [c.finish_reason for c in forked.outputs] == ["error"] * 3
    assert [c.token_ids for c in fine.outputs] == [hf_greedy(hf_model, good[0], 6)] * 3
    assert llm.memory_stats().num_sequences == 0


def test_stream_buffer_pauses_at_its_bound_and_resumes_at_half() -> None:
    async def scenario() -> None:
        resumed = []
        buffer: StreamBuffer[int] = StreamBuffer(asyncio.get_running_loop(), 4, lambda: resumed.append(True))
        assert [buffer.put(i) for i in range(4)] == [True, True, True, False]  # the 4th fills it: pause
        assert buffer.is_full and buffer.num_items == 4
        assert await buffer.get() == 0 and not resumed  # 3 left: still above half
        assert await buffer.get() == 1 and resumed == [True] and not buffer.is_full  # 2 left: resume
        assert [await buffer.get(), await buffer.get()] == [2, 3] and resumed == [True]
        assert buffer.num_items == 0

    asyncio.run(scenario())
