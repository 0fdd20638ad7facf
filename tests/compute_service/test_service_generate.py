"""Generation features over the wire: a real memory service and a real compute service (tiny model).

Every expectation comes from transformers (same weights) or from the tokenizer itself.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

import pagedserve_kernels as kernels
from pagedserve.compute.v1 import compute_pb2 as cpb

from pagedserve_testing.tiny_model import EOS_PROMPT, ServiceModel, hf_greedy
from tests.compute_service.service_fixtures import Services, running_services
from tests.processes import child_pids

PROMPTS = [EOS_PROMPT, [40, 97, 109, 32, 97, 32, 116, 105, 110, 121], list(range(33, 33 + 21))]


@pytest.fixture(scope="module")
def model(service_model: ServiceModel) -> ServiceModel:
    return service_model


@pytest.fixture(scope="module")
def services(model: ServiceModel) -> Iterator[Services]:
    with running_services(model.path) as services:
        yield services


def tokens_of(messages: list[cpb.GenerateResponse], index: int = 0) -> list[int]:
    return [t for m in messages if m.index == index for t in m.token_ids]


def text_of(messages: list[cpb.GenerateResponse], index: int = 0) -> str:
    return "".join(m.text for m in messages if m.index == index)


def test_greedy_equals_transformers_and_pieces_concatenate(services: Services, model: ServiceModel) -> None:
    for prompt in PROMPTS:
        messages = services.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
        tokens = tokens_of(messages)
        assert tokens == hf_greedy(model.hf_model, prompt, 16)
        # One message per engine step: one token each, or several when speculative drafts were
        # accepted (engine/speculative.py), never none.
        assert all(m.token_ids for m in messages)
        # Byte tokens split characters: no piece is a broken character, and they add up exactly.
        assert text_of(messages) == model.tokenizer.decode(tokens, skip_special_tokens=True)
        assert [m.finish_reason for m in messages] == [""] * (len(messages) - 1) + ["length"]
        assert messages[-1].usage == cpb.Usage(prompt_tokens=len(prompt), completion_tokens=16,
                                               cached_prompt_tokens=messages[-1].usage.cached_prompt_tokens)
        assert not any(m.HasField("usage") for m in messages[:-1])


def test_eos_min_tokens_and_ignore_eos(services: Services, model: ServiceModel) -> None:
    want = hf_greedy(model.hf_model, EOS_PROMPT, 12)
    eos_at = want.index(model.eos_token_id)
    messages = services.generate(EOS_PROMPT, max_tokens=12, temperature=0.0)
    assert tokens_of(messages) == want[: eos_at + 1] and messages[-1].finish_reason == "eos"
    messages = services.generate(EOS_PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert tokens_of(messages) == want and messages[-1].finish_reason == "length"
    messages = services.generate(EOS_PROMPT, max_tokens=12, temperature=0.0, min_tokens=eos_at + 3)
    tokens = tokens_of(messages)
    assert len(tokens) >= eos_at + 3 and model.eos_token_id not in tokens[: eos_at + 3]
    assert tokens[:eos_at] == want[:eos_at]


def test_stop_token_ids(services: Services, model: ServiceModel) -> None:
    want = hf_greedy(model.hf_model, PROMPTS[1], 16)
    stop = want[2]
    messages = services.generate(PROMPTS[1], max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    assert tokens_of(messages) == want[: want.index(stop) + 1]
    assert messages[-1].finish_reason == "stop" and messages[-1].stop_token_id == stop
    assert messages[-1].WhichOneof("matched_stop") == "stop_token_id"


def test_stop_string_across_token_boundaries(services: Services, model: ServiceModel) -> None:
    prompt = PROMPTS[2]
    want = hf_greedy(model.hf_model, prompt, 24)
    full = model.tokenizer.decode(want, skip_special_tokens=True)
    # A 2-character stop string from the middle: each byte token is at most one character, so
    # the match always spans a token boundary.
    start = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    cut = full.find(stop)
    messages = services.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop, "never-seen"])
    assert text_of(messages) == full[:cut]
    assert messages[-1].finish_reason == "stop" and messages[-1].stop_string == stop
    # Stopped at once: the first token whose text completes the stop string is the last one.
    num = next(k for k in range(1, 25) if stop in model.tokenizer.decode(want[:k], skip_special_tokens=True))
    assert tokens_of(messages) == want[:num]


def test_seeded_sampling_is_reproducible_whatever_else_runs(services: Services) -> None:
    params = dict(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                  presence_penalty=0.2, frequency_penalty=0.1, ignore_eos=True)
    alone = tokens_of(services.generate(PROMPTS[1], seed=7, **params))
    assert alone == tokens_of(services.generate(PROMPTS[1], seed=7, **params))
    assert alone != tokens_of(services.generate(PROMPTS[1], seed=8, **params))
    # The same seeded request again, now batched with other requests of different lengths.
    results: dict[int, list[int]] = {}

    def other(i: int) -> None:
        results[i] = tokens_of(services.generate(PROMPTS[i % 3], max_tokens=40, temperature=1.0, ignore_eos=True))

    threads = [threading.Thread(target=other, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    batched = tokens_of(services.generate(PROMPTS[1], seed=7, **params))
    for t in threads:
        t.join()
    assert batched == alone and all(len(r) == 40 for r in results.values())


def test_logprobs_are_log_softmax_of_the_reference_logits(services: Services, model: ServiceModel) -> None:
    prompt = PROMPTS[1]
    messages = services.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    tokens = tokens_of(messages)
    with torch.no_grad():
        logits = model.hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)  # (6, V)
    lps = [lp for m in messages for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == tokens
    for row, lp in zip(reference, lps):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        values, ids = row.topk(3)
        assert list(lp.top_token_ids) == ids.tolist()
        assert list(lp.top_logprobs) == pytest.approx(values.tolist(), abs=1e-4)
    # logprobs=0: the sampled token's only.
    messages = services.generate(prompt, max_tokens=2, temperature=0.0, logprobs=0)
    assert all(len(lp.top_token_ids) == 0 and math.isfinite(lp.logprob) for m in messages for lp in m.logprobs)


def test_n_completions_share_the_prompt_blocks(services: Services) -> None:
    prompt = PROMPTS[1]  # 10 tokens: 2 full blocks of 4 and a partial one, shared by the forks
    before = services.memory_stats()
    messages = services.generate(prompt, n=3, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    after = services.wait_released()
    assert {m.index for m in messages} == {0, 1, 2}
    assert [len(tokens_of(messages, i)) for i in range(3)] == [12, 12, 12]
    assert len({tuple(tokens_of(messages, i)) for i in range(3)}) > 1
    assert sorted(m.finish_reason for m in messages if m.finish_reason) == ["length"] * 3
    assert messages[-1].usage.completion_tokens == 36
    # The partial prompt block was shared by all three: two of them copied it on their first write.
    assert after.num_copy_on_writes - before.num_copy_on_writes == 2


def test_prefix_cache_and_cache_salt(services: Services) -> None:
    prompt = list(range(60, 60 + 17))  # 4 full blocks
    services.generate(prompt, max_tokens=2, temperature=0.0)
    again = services.generate(prompt, max_tokens=2, temperature=0.0)
    salted = services.generate(prompt, max_tokens=2, temperature=0.0, cache_salt="tenant-b")
    assert again[-1].usage.cached_prompt_tokens == 16
    assert salted[-1].usage.cached_prompt_tokens == 0


def test_info_and_tokenizer_files_rebuild_the_tokenizer(services: Services, model: ServiceModel,
                                                          tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    info = services.stub.Info(cpb.InfoRequest())
    assert (info.vocab_size, info.max_model_len, info.block_size, info.dtype, info.device) == (
        258, 1024, 4, "float32", "cpu")
    assert list(info.eos_token_ids) == [model.eos_token_id, 257] and info.bos_token_id == 256
    assert info.num_kv_blocks == 128 and info.max_n == 64 and info.default_params.temperature == 1.0
    # The memory service it is attached to (the gateway routes backends with one id as one cache).
    assert info.memory_service_id.startswith("ms-") and len(info.kv_tiers) == 0
    assert info.chat_template == model.tokenizer.chat_template
    assert info.kernels == kernels.step_path(torch.device("cpu"), torch.float32, 16)  # "fused-cpp native" here
    assert dict(info.kernel_paths) == kernels.kernel_paths(torch.device("cpu"), torch.float32, 16)
    if info.kernels.startswith("fused-cpp"):  # a float32 model: no small-batch rows (bf16 only)
        assert info.kernel_paths["linear"] in ("onednn", "torch")
    chunks = list(services.stub.GetTokenizer(cpb.GetTokenizerRequest()))
    for f in info.tokenizer_files:
        data = b"".join(c.data for c in chunks if c.name == f.name)
        assert [c.sha256 for c in chunks if c.name == f.name][-1] == f.sha256 == hashlib.sha256(data).hexdigest()
        assert len(data) == f.size
        (tmp_path / f.name).write_bytes(data)
    rebuilt = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "héllo, wörld €"
    assert rebuilt.encode(text) == model.tokenizer.encode(text)
    assert rebuilt.chat_template == model.tokenizer.chat_template


def test_no_grammar_compile_worker_runs_before_the_first_constraint(services: Services) -> None:
    """This module sends no constraint: the compute service started no worker process (each costs
    seconds of CPU importing xgrammar). Before: two compile workers at every start."""
    services.generate(PROMPTS[0], max_tokens=2)
    assert child_pids(services.compute.pid) == []


def test_load_reports_idle_engine(services: Services) -> None:
    load = services.stub.Load(cpb.LoadRequest())
    assert (load.num_running, load.num_waiting, load.num_pending_tokens) == (0, 0, 0)
    assert load.max_queued_requests == 256 and 0.0 <= load.kv_usage <= 1.0
    assert 0.0 < load.prefix_cache_hit_rate < 1.0  # earlier tests repeated a prompt


def test_priority_is_accepted(services: Services, model: ServiceModel) -> None:
    messages = services.generate(PROMPTS[0], max_tokens=4, temperature=0.0, ignore_eos=True, priority=3)
    assert tokens_of(messages) == hf_greedy(model.hf_model, PROMPTS[0], 4)


def test_a_request_that_can_never_fit_the_pool_is_rejected_up_front(services: Services) -> None:
    assert services.stub.Abort(cpb.AbortRequest(request_id="nobody")).found is False
    with pytest.raises(grpc.RpcError) as err:  # 128 blocks of 4 = 512 tokens < 10 + 600 <= 1024
        services.generate(PROMPTS[1], max_tokens=600)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV pool" in err.value.details()
