"""The engine end to end on a tiny random-weight Llama: token-for-token equal to transformers.

Every scenario (prefix caching on/off, chunked prefill, preemption, late arrivals, priorities,
forks) must produce exactly the greedy tokens of `transformers` `generate` with the same weights.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from compute_service import LLM, SamplingParams
from compute_service.engine.outputs import RequestOutput, collect

from tests.compute_service.tiny_llama import (EOS, VOCAB, hf_greedy, in_process_engine, load_hf, save_tiny_llama,
                                              to_causal_lm)



@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> LlamaForCausalLM:
    return load_hf(tiny_dir)


def make_prompts(num: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(num)]


def expected(hf_model: LlamaForCausalLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [hf_greedy(hf_model, p, max_tokens) for p in prompts]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_equals_transformers(tiny_dir: Path, hf_model: LlamaForCausalLM, enable_prefix_caching: bool) -> None:
    prompts = make_prompts(8, seed=1, shared_prefix=10)
    with LLM(str(tiny_dir), dtype="float32",
             block_size=4, max_num_blocks=256, enable_prefix_caching=enable_prefix_caching) as llm:
        first = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts, GREEDY)  # second round: the prompts' blocks are cached now
        stats = llm.memory_stats()
    want = expected(hf_model, prompts, 24)
    assert [o.token_ids for o in first] == want
    assert [o.token_ids for o in again] == want
    if enable_prefix_caching:
        assert all(o.num_cached_tokens >= 8 for o in again)
        assert stats.prefix_cache_hits > 0
    else:
        assert all(o.num_cached_tokens == 0 for o in again) and stats.prefix_cache_hits == 0


def test_chunked_prefill_and_small_batches(tiny_dir: Path, hf_model: LlamaForCausalLM) -> None:
    prompts = make_prompts(6, seed=2, shared_prefix=30)
    with LLM(str(tiny_dir), dtype="float32",
             block_size=4, max_num_blocks=256, max_num_seqs=3, max_num_batched_tokens=8) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert llm.engine.num_steps > sum(len(p) for p in prompts) // 8  # prompts really went in chunks
    assert [o.token_ids for o in outs] == expected(hf_model, prompts, 24)


def test_preemption_by_recompute(tiny_dir: Path, hf_model: LlamaForCausalLM) -> None:
    prompts = make_prompts(8, seed=3)
    # 24 blocks of 4 tokens: far too few for 8 sequences of up to 40 + 24 tokens at once.
    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=24, max_num_seqs=8) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert llm.engine.scheduler.num_preemptions > 0
        stats = llm.memory_stats()
    assert [o.token_ids for o in outs] == expected(hf_model, prompts, 24)
    assert stats.num_sequences == 0


def test_in_process_allocator_runs_like_the_memory_service(tiny_dir: Path, hf_model: LlamaForCausalLM) -> None:
    """The same engine on the memory service (a process, gRPC, shared memory) and on the in-process
    allocator: the same tokens, steps, preemptions and blocks, step for step."""
    prompts = make_prompts(6, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def drive(engine) -> tuple[list[list[int]], list[list[list[int]]]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        results: dict[str, RequestOutput] = {}
        tables = []  # every running sequence's block table after each step
        while engine.has_unfinished():
            collect(results, engine.step())
            tables.append([list(s.block_table) for s in engine.scheduler.running])
        return [results[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], tables

    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=24, max_num_seqs=6,
             admission_watermark=0.0) as llm:
        remote = drive(llm.engine)
        remote_counts = (llm.engine.num_steps, llm.engine.scheduler.num_preemptions)
    local_engine = in_process_engine(*to_causal_lm(hf_model), num_blocks=24, max_num_seqs=6, admission_watermark=0.0)
    local = drive(local_engine)
    assert local == remote
    assert (local_engine.num_steps, local_engine.scheduler.num_preemptions) == remote_counts
    assert remote_counts[1] > 0  # the pool is small enough to preempt
    assert remote[0] == [hf_greedy(hf_model, p, 12, ignore_eos=True) for p in prompts]


def test_requests_arriving_while_others_decode(tiny_dir: Path, hf_model: LlamaForCausalLM) -> None:
    prompts = make_prompts(6, seed=4, shared_prefix=8)
    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=256) as llm:
        engine = llm.engine
        done = {}
        results: dict[str, RequestOutput] = {}
        for tick in range(10_000):
            if tick % 3 == 0 and tick // 3 < len(prompts):  # a new request every third step
                engine.add_request(f"r{tick // 3}", prompts[tick // 3], GREEDY)
            for out in collect(results, engine.step()):
                done[out.request_id] = out.token_ids
            if len(done) == len(prompts):
                break
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected(hf_model, prompts, 24)


def test_priority_jumps_the_queue(tiny_dir: Path) -> None:
    prompts = make_prompts(4, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=64, max_num_seqs=1) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts[:3]):
            engine.add_request(f"low{i}", prompt, params, priority=0)
        engine.step()  # low0 starts
        engine.add_request("high", prompts[3], params, priority=5)
        order = []
        while engine.has_unfinished():
            order += [o.request_id for o in engine.step() if o.finished]  # deltas: finished once
    assert order == ["low0", "high", "low1", "low2"]


def test_high_priority_preempts_lower_when_blocks_run_out(tiny_dir: Path, hf_model: LlamaForCausalLM) -> None:
    rng = random.Random(9)
    low = [rng.randrange(2, VOCAB) for _ in range(30)]  # 8 blocks of 4
    high = [rng.randrange(2, VOCAB) for _ in range(12)]  # 3 blocks
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=10, max_num_seqs=2) as llm:
        engine = llm.engine
        engine.add_request("low", low, params, priority=0)
        results: dict[str, RequestOutput] = {}
        collect(results, engine.step())  # low's whole prompt: 8 of the 10 blocks (and its first token)
        engine.add_request("high", high, params, priority=5)
        finished = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o.token_ids for o in collect(results, engine.step())})
        assert engine.scheduler.num_preemptions >= 1
        assert list(finished) == ["high", "low"]
    assert finished["low"] == hf_greedy(hf_model, low, 6)
    assert finished["high"] == hf_greedy(hf_model, high, 6)


@pytest.fixture(scope="module")
def llm128(tiny_dir: Path) -> Iterator[LLM]:
    """128 blocks of 4 tokens, the defaults otherwise: shared by the tests that need no pool of
    their own (each leaves it idle and counts from where it starts)."""
    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=128) as llm:
        yield llm


def test_parallel_sampling_forks_share_the_prompt(llm128: LLM, hf_model: LlamaForCausalLM) -> None:
    prompt = make_prompts(1, seed=6)[0]
    llm = llm128
    copies = llm.memory_stats().num_copy_on_writes
    [greedy] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, n=3))
    assert llm.memory_stats().num_copy_on_writes - copies >= (1 if len(prompt) % 4 else 0)
    [sampled] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7))
    [again] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7))
    want = hf_greedy(hf_model, prompt, 12)
    assert [c.token_ids for c in greedy.outputs] == [want] * 3
    assert [c.token_ids for c in sampled.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1


def test_stop_token_ids_at_their_limit_stop_at_the_right_token(llm128: LLM, hf_model: LlamaForCausalLM) -> None:
    """1,024 stop ids (the limit) are looked up in a set built once per request, and stop exactly
    where the one that the model generates first appears."""
    prompt = make_prompts(1, seed=8)[0]
    want = hf_greedy(hf_model, prompt, 12)
    stop_id = want[5]
    others = [t for t in range(VOCAB) if t not in want]  # never generated: repeated up to the limit
    stop_ids = [*(others * (1023 // len(others) + 1))[:1023], stop_id]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=stop_ids)
    assert params.stop_token_id_set == frozenset([*others, stop_id]) and len(params.stop_token_ids) == 1024
    first = want.index(stop_id)
    held_back = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=stop_ids, min_tokens=first + 2)
    [out] = llm128.generate([prompt], params)
    [masked] = llm128.generate([prompt], held_back)  # the stop ids are masked under min_tokens
    assert out.outputs[0].token_ids == want[:first + 1] and out.outputs[0].finish_reason == "stop"
    tokens = masked.outputs[0].token_ids
    assert tokens[:first] == want[:first] and stop_id not in tokens[:first + 2] and len(tokens) >= first + 2
    # Built once for the request: EOS and the stop ids, whatever the number of steps.
    assert set(held_back.derived["min_tokens_banned"].tolist()) == {*held_back.stop_token_id_set, EOS}
    with pytest.raises(ValueError, match="stop_token_ids: at most 1024 ids, got 1025"):
        SamplingParams(stop_token_ids=[1] * 1025)


def test_abort_and_bad_input(tiny_dir: Path) -> None:
    with LLM(str(tiny_dir), dtype="float32", block_size=4, max_num_blocks=64) as llm:
        engine = llm.engine
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        engine.step()
        assert engine.abort("a")
        outs = engine.step()
        assert [(o.request_id, o.finished, [c.finish_reason for c in o.completions]) for o in outs] == [
            ("a", True, ["abort"])]
        engine.step()  # frees the aborted sequence's blocks
        assert llm.memory_stats().num_sequences == 0
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate([[VOCAB + 5]], max_tokens=2)
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate([[3, 4]], max_tokens=0)
        with pytest.raises(ValueError, match="KV pool"):
            llm.generate([[3] * 200], max_tokens=200)
        # Still serving after bad input.
        assert len(llm.generate([[3, 4]], max_tokens=2, temperature=0.0)[0].token_ids) == 2
