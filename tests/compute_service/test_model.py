"""Our paged Llama-family forward against transformers' own models, logit for logit.

Each tiny model runs through prefill, packed batches, decode and chunked prefill with shuffled,
non-contiguous block ids; the reference recomputes every sequence from scratch without a cache.
The KV pool starts as large random garbage, so reading a slot that was never written shows.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from compute_service.model.forward_batch import ForwardBatch
from compute_service.model.model import CausalLM
from compute_service.model.model_loader import LoadedModel, load_model
from tests.conftest import TINY_VARIANTS, TinyModel

BLOCK_SIZE = 4  # small, so that sequences and chunks cross many block boundaries
ATOL = RTOL = 1e-5


class PagedSequences:
    """Test double of the memory service: a KV pool, shuffled block ids, per-sequence counters."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        shape = model.config.kv_pool_shape(num_blocks, BLOCK_SIZE)
        self.kv_pool = (100 * torch.randn(shape, generator=generator)).to(model.device, model.dtype)
        self.free_block_ids = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_block_ids)
        self.model = model
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> torch.Tensor:
        """Run one forward over the given new tokens of each sequence; returns (B, vocab) logits."""
        for seq_id, tokens in new_tokens.items():
            table = self.block_tables.setdefault(seq_id, [])
            seq_len = self.num_computed.get(seq_id, 0) + len(tokens)
            while len(table) * BLOCK_SIZE < seq_len:
                table.append(self.free_block_ids.pop())
        batch = ForwardBatch.build(
            new_token_ids=list(new_tokens.values()),
            num_computed_tokens=[self.num_computed.get(s, 0) for s in new_tokens],
            block_tables=[self.block_tables[s] for s in new_tokens],
            block_size=BLOCK_SIZE,
            device=self.model.device,
        )
        logits = self.model(batch, self.kv_pool).cpu()
        for seq_id, tokens in new_tokens.items():
            self.num_computed[seq_id] = self.num_computed.get(seq_id, 0) + len(tokens)
        return logits


def reference_logits(tiny: TinyModel, sequences: list[list[int]]) -> torch.Tensor:
    """transformers' next-token logits after each whole sequence, no cache: (B, vocab)."""
    with torch.no_grad():
        return torch.stack([tiny.hf_model(torch.tensor([s])).logits[0, -1] for s in sequences])


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=TINY_VARIANTS)
def tiny(request, make_tiny_model) -> tuple[TinyModel, LoadedModel]:
    """Each tiny variant, and our model loaded from its saved directory by the real loader."""
    tiny = make_tiny_model(request.param)
    return tiny, load_model(str(tiny.path), device="cpu", dtype="float32")


def test_single_prefill_matches_transformers(tiny):
    ref, ours = tiny
    prompt = random_tokens(11, seed=1)
    logits = PagedSequences(ours.model).step({"a": prompt})
    assert logits.shape == (1, 128) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(ref, [prompt]), atol=ATOL, rtol=RTOL)


def test_packed_batch_of_three_prompts(tiny):
    ref, ours = tiny
    prompts = [random_tokens(5, seed=2), random_tokens(13, seed=3), random_tokens(1, seed=4)]
    logits = PagedSequences(ours.model).step(dict(zip("abc", prompts)))
    torch.testing.assert_close(logits, reference_logits(ref, prompts), atol=ATOL, rtol=RTOL)


def test_decode_steps_after_prefill_reuse_the_pool(tiny):
    ref, ours = tiny
    seqs = {"a": random_tokens(6, seed=5), "b": random_tokens(9, seed=6), "c": random_tokens(3, seed=7)}
    paged = PagedSequences(ours.model)
    logits = paged.step({k: list(v) for k, v in seqs.items()})
    for _ in range(5):
        next_tokens = logits.argmax(dim=-1).tolist()
        for seq, token in zip(seqs.values(), next_tokens):
            seq.append(token)
        logits = paged.step({k: [v[-1]] for k, v in seqs.items()})  # one new token each
        torch.testing.assert_close(logits, reference_logits(ref, list(seqs.values())), atol=ATOL, rtol=RTOL)
    assert paged.num_computed == {"a": 11, "b": 14, "c": 8}


def test_chunked_prefill_on_cached_context_mixed_with_decode(tiny):
    ref, ours = tiny
    prompt = random_tokens(23, seed=8)
    other = random_tokens(7, seed=9)
    paged = PagedSequences(ours.model)
    paged.step({"long": prompt[:8], "other": other})  # the first chunk plays the cached prefix
    for lo, hi in ((8, 14), (14, 23)):
        other.append(int(torch.randint(0, 128, (1,)).item()))
        logits = paged.step({"other": [other[-1]], "long": prompt[lo:hi]})  # decode + chunk in one batch
        torch.testing.assert_close(logits, reference_logits(ref, [other, prompt[:hi]]), atol=ATOL, rtol=RTOL)
    table = paged.block_tables["long"]
    assert len(table) == 6 and table != sorted(table)  # really non-contiguous


def test_bfloat16_stays_close_to_float32(make_tiny_model):
    tiny = make_tiny_model("llama")
    prompts = [random_tokens(9, seed=10), random_tokens(4, seed=11)]
    bf16 = load_model(str(tiny.path), device="cpu", dtype="bfloat16").model
    assert bf16.dtype == torch.bfloat16
    logits = PagedSequences(bf16).step(dict(zip("ab", prompts)))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(tiny, prompts), atol=0.05, rtol=0.05)


def test_forward_rejects_a_pool_of_the_wrong_shape_or_dtype(make_tiny_model):
    model = load_model(str(make_tiny_model("llama").path), device="cpu", dtype="float32").model
    batch = ForwardBatch.build([[1, 2, 3]], [0], [[0]], BLOCK_SIZE)
    shape = model.config.kv_pool_shape(4, BLOCK_SIZE)
    with pytest.raises(ValueError, match="kv_pool must be"):
        model(batch, torch.zeros((3, *shape[1:])))  # one layer too many
    with pytest.raises(ValueError, match="bfloat16"):
        model(batch, torch.zeros(shape, dtype=torch.bfloat16))


def test_forward_batch_build_maps_positions_to_slots():
    batch = ForwardBatch.build([[7, 8, 9], [5]], [2, 6], [[3, 1], [4, 0]], block_size=4)
    assert batch.input_ids.tolist() == [7, 8, 9, 5]
    assert batch.positions.tolist() == [2, 3, 4, 6]
    # position p -> table[p // 4] * 4 + p % 4
    assert batch.slot_mapping.tolist() == [14, 15, 4, 2]
    assert batch.seq_lens.tolist() == [5, 7]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4]
    assert batch.block_tables.dtype == torch.int32 and batch.block_tables.tolist() == [[3, 1], [4, 0]]


def test_forward_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.build([[1, 2, 3, 4, 5]], [0], [[0]], block_size=4)
    with pytest.raises(ValueError, match="one of each"):
        ForwardBatch.build([[1]], [0, 0], [[0]], block_size=4)
    with pytest.raises(ValueError, match="positions"):
        ForwardBatch(
            input_ids=torch.zeros(3, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64),
            slot_mapping=torch.zeros(3, dtype=torch.int64), block_tables=torch.zeros(1, 1, dtype=torch.int32),
            seq_lens=torch.zeros(1, dtype=torch.int32), cu_seqlens_q=torch.zeros(2, dtype=torch.int32),
        )


def test_load_weights_rejects_unknown_and_missing_tensors(make_tiny_model, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_PREPACK", "0")  # a prepacked model refuses any reload
    tiny = make_tiny_model("llama")
    model = load_model(str(tiny.path), device="cpu", dtype="float32").model
    state = tiny.hf_model.state_dict()
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([*state.items(), ("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        model.load_weights([(k, v) for k, v in state.items() if k != "model.norm.weight"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-3), (torch.bfloat16, 0.05)])
def test_cuda_triton_path_matches_transformers(make_tiny_model, dtype, tolerance):
    """The same chunked-prefill + decode mix on CUDA, where the Triton kernels run."""
    tiny = make_tiny_model("qwen2")
    model = load_model(str(tiny.path), device="cuda", dtype=dtype).model
    prompt, other = random_tokens(23, seed=12), random_tokens(7, seed=13)
    paged = PagedSequences(model)
    paged.step({"long": prompt[:10], "other": other})
    other.append(3)
    logits = paged.step({"other": [3], "long": prompt[10:]})
    torch.testing.assert_close(logits, reference_logits(tiny, [other, prompt]), atol=tolerance, rtol=tolerance)


# -- the real default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_reference(default_model):
    """transformers' LlamaForCausalLM over the same converted directory, float32, eager attention."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(
        default_model.source.path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_model, default_reference):
    tok = default_model.tokenizer
    prompts = [tok("The quick brown fox jumps over").input_ids, tok("def fibonacci(n):\n    ").input_ids]
    logits = PagedSequences(default_model.model, num_blocks=32).step(dict(zip("ab", prompts)))
    with torch.no_grad():
        expected = torch.stack([default_reference(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.slow
def test_default_model_answers_paris_greedily(default_model, default_reference):
    tok, config = default_model.tokenizer, default_model.config
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    paged = PagedSequences(default_model.model, num_blocks=32)
    logits, output = paged.step({"q": prompt}), []
    while len(output) < 10:
        token = int(logits[0].argmax())
        if token in config.eos_token_ids:
            break
        output.append(token)
        logits = paged.step({"q": [token]})
    assert "Paris" in tok.decode(output)
    with torch.no_grad():  # token for token what transformers' greedy search produces
        expected = default_reference.generate(
            torch.tensor([prompt]), max_new_tokens=len(output), do_sample=False, eos_token_id=None
        )[0, len(prompt):]
    assert output == expected.tolist()


def test_forward_batch_build_matches_the_per_token_rule_on_mixed_batches():
    """Decodes, prompt chunks over cached context and fresh prompts, spanning blocks, in one batch."""
    rng = random.Random(0)
    for _ in range(300):
        block_size = rng.choice([1, 2, 4, 16])
        new, starts, tables = [], [], []
        for _ in range(rng.randint(1, 12)):
            num_new, start = rng.choice([1, 1, rng.randint(1, 40)]), rng.randint(0, 60)
            num_blocks = -(-(start + num_new) // block_size) + rng.randint(0, 2)
            new.append([rng.randrange(50000) for _ in range(num_new)])
            starts.append(start)
            tables.append([rng.randrange(5000) for _ in range(num_blocks)])
        batch = ForwardBatch.build(new, starts, tables, block_size)
        positions = [p for s, t in zip(starts, new) for p in range(s, s + len(t))]
        owner = [b for b, t in enumerate(new) for _ in t]
        assert batch.input_ids.tolist() == [t for tokens in new for t in tokens]
        assert batch.positions.tolist() == positions
        assert batch.slot_mapping.tolist() == [
            tables[b][p // block_size] * block_size + p % block_size for b, p in zip(owner, positions)
        ]
        width = max(map(len, tables))
        assert batch.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
        assert batch.seq_lens.tolist() == [s + len(t) for s, t in zip(starts, new)]
        assert batch.cu_seqlens_q.tolist() == [0, *itertools.accumulate(len(t) for t in new)]
        assert [x.dtype for x in (batch.input_ids, batch.positions, batch.slot_mapping)] == [torch.int64] * 3
        assert [x.dtype for x in (batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)] == [torch.int32] * 3
