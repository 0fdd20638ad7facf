"""GGUF files served directly: a tiny random model written as a GGUF (as llama.cpp's converter writes
one: q/k rows permuted for llama, 1-D tensors in F32, the LM head left out when tied), loaded by our
loader, must generate what transformers generates from the same file (its own GGUF loader, which
de-quantizes and un-permutes on its own), token for token; the tokenizer built from the file must
encode as the source tokenizer does; what we do not run is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve_testing.tiny_model import hf_greedy

from compute_service.model import gguf_file, model_loader
from compute_service.model.model_loader import load_model, resolve_model
from tests.compute_service.test_model import PagedSequences
from tests.conftest import TINY_SHAPE

PROMPT = [5, 17, 42, 99, 3, 64, 7, 120]
TEXT = "Hello world! GGUF files, served directly: 1234 tokens.\n<|im_start|>user\nhi<|im_end|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_LAYER_NAMES = {hf: gg for gg, hf in gguf_file._LAYER_TENSORS.items()}
_GLOBAL_NAMES = {hf: gg for gg, hf in gguf_file._GLOBAL_TENSORS.items()}


def _gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)  # model.layers.N.<module>
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: rotary halves to interleaved pairs."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _train_tokenizer():
    """A small byte-level BPE with ChatML's special tokens and Qwen2's pre-tokenizer (as a Qwen2
    tokenizer.json has it: digits one by one), trained in milliseconds."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["Hello world, the files are served directly.", "GGUF tokens 1234 and more words"] * 20,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def write_gguf(hf_model: torch.nn.Module, path: Path, qtype: str, *, arch: str, tokenizer=None,
               tensor_types: dict[str, str] | None = None, rope_freqs: np.ndarray | None = None) -> Path:
    """`hf_model` as llama.cpp would write it in `qtype` (matrices only; 1-D tensors stay F32).
    `tensor_types` overrides the type of single tensors (by GGUF name), with random bytes;
    `rope_freqs` is written as llama.cpp writes Llama 3's rope scaling."""
    import gguf

    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer is not None:
        vocab = tokenizer.backend_tokenizer.get_vocab()
        tokens = sorted(vocab, key=vocab.get)
        tokens += [f"[PAD{i}]" for i in range(config.vocab_size - len(tokens))]  # as llama.cpp pads
        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else
                                gguf.TokenType.USER_DEFINED if t.startswith("[PAD") else gguf.TokenType.NORMAL
                                for t in tokens])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
        writer.add_bos_token_id(tokenizer.bos_token_id)
        writer.add_eos_token_id(tokenizer.eos_token_id)
        writer.add_chat_template(tokenizer.chat_template)
    qtype_enum = gguf.GGMLQuantizationType[qtype]
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name)
        data = tensor.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = _permute(data, config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads)
        if tensor_types and name in tensor_types:
            kind = gguf.GGMLQuantizationType[tensor_types[name]]
            writer.add_tensor(name, _random_blocks(data.shape, kind), raw_dtype=kind)
        elif data.ndim == 1 or qtype == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype_enum), raw_dtype=qtype_enum)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _random_blocks(shape: tuple[int, ...], kind) -> np.ndarray:
    """Random blocks of a k-quant type whose f16 scales are small and finite: (rows, bytes per row)."""
    import gguf

    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    blocks = np.random.default_rng(0).integers(0, 256, (rows * cols // block_elements, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if kind.name == "Q6_K":  # ql, qh, scales, then d at the end
        blocks[:, -2:] = scale
    else:  # d then dmin first (Q4_K, Q5_K)
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    return blocks.reshape(rows, cols // block_elements * block_bytes)


def _hf_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own loading of the file (de-quantizing and un-permuting itself), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _our_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Our model's greedy tokens over a paged KV pool: one prefill, then one token a step (decode)."""
    paged = PagedSequences(model)
    logits, output = paged.step({"s": prompt}), []
    while len(output) < max_tokens:
        output.append(int(logits[0].argmax()))
        logits = paged.step({"s": [output[-1]]})
    return output


ARCH = {"llama": "llama", "llama-tied": "llama", "mistral": "llama", "qwen2": "qwen2"}
CASES = [("llama", "F32"), ("llama", "Q8_0"), ("llama-tied", "Q4_0"), ("llama", "BF16"),
         ("qwen2", "F16"), ("qwen2", "Q4_0"), ("mistral", "Q8_0")]


@pytest.mark.parametrize(("variant", "qtype"), CASES, ids=[f"{v}-{q}" for v, q in CASES])
def test_gguf_greedy_equals_transformers_from_the_same_file(variant, qtype, make_tiny_model, tmp_path):
    tiny = make_tiny_model(variant)
    path = write_gguf(tiny.hf_model, tmp_path / f"tiny-{variant}.{qtype}.gguf", qtype, arch=ARCH[variant])
    loaded = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32", quantization="none")
    reference = _hf_from_gguf(path)
    assert loaded.source.name == path.stem and loaded.source.was_converted
    assert loaded.config.model_type == ("qwen2" if variant == "qwen2" else "llama")
    assert loaded.config.tie_word_embeddings == (variant == "llama-tied")
    hf_config = tiny.hf_model.config
    assert loaded.config.qkv_bias == (variant == "qwen2")
    assert loaded.config.head_dim == (getattr(hf_config, "head_dim", None)
                                      or hf_config.hidden_size // hf_config.num_attention_heads)
    # The de-quantized weights are transformers' own, exactly (F32, F16 and BF16: the model's, exactly).
    ours = dict(model_loader._iter_weights(loaded.source.path))
    for name, weight in reference.state_dict().items():
        if name == "lm_head.weight" and variant == "llama-tied":
            continue
        torch.testing.assert_close(ours[name].float(), weight, rtol=0, atol=0, msg=name)
        if qtype in ("F32", "F16", "BF16") or weight.ndim == 1:  # 1-D tensors are F32 in every file
            stored = {"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype) if weight.ndim == 2 else None
            source = tiny.hf_model.state_dict()[name].to(stored or torch.float32).float()
            torch.testing.assert_close(ours[name].float(), source, rtol=0, atol=0, msg=name)
    assert _our_greedy(loaded.model, PROMPT, 12) == hf_greedy(reference, PROMPT, 12)


def test_gguf_k_quants_equal_transformers(tmp_path):
    """Q4_K, Q5_K and Q6_K blocks (256 values each, so a wider model), de-quantized by gguf and
    by transformers' own reader: the same weights and the same greedy tokens."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    types = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_K", "blk.0.attn_v.weight": "Q6_K",
             "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q5_K", "blk.0.ffn_up.weight": "Q6_K",
             "blk.0.ffn_down.weight": "Q4_K", "output.weight": "Q6_K"}
    path = write_gguf(hf_model, tmp_path / "tiny-k.gguf", "F16", arch="llama", tensor_types=types)
    loaded = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32", quantization="none")
    reference = _hf_from_gguf(path)
    ours = dict(model_loader._iter_weights(loaded.source.path))
    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(ours[name].float(), weight, rtol=0, atol=0, msg=name)
    assert _our_greedy(loaded.model, PROMPT, 8) == hf_greedy(reference, PROMPT, 8)


def test_gguf_llama3_rope_is_recognised_from_rope_freqs(tmp_path):
    """Llama 3.1's rope scaling, which a GGUF holds only as llama.cpp's per-frequency divisors."""
    import transformers

    from compute_service.model.model_config import RopeConfig

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    config = transformers.LlamaConfig(**{**TINY_SHAPE, "max_position_embeddings": 16384}, rope_theta=500000.0,
                                      rope_scaling=params)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    # head_dim 16 at theta 500000 puts the 8 frequencies in all three bands of the llama3 rule.
    divisors = gguf_file._llama3_divisors(500000.0, 16, params).numpy()
    assert 1.0 in divisors and 8.0 in divisors and ((divisors > 1) & (divisors < 8)).any()
    path = write_gguf(hf_model, tmp_path / "llama3.gguf", "F32", arch="llama", rope_freqs=divisors)
    loaded = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32", quantization="none")
    assert loaded.config.rope == RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position=8192)
    assert _our_greedy(loaded.model, PROMPT, 12) == hf_greedy(hf_model, PROMPT, 12)
    unknown = write_gguf(hf_model, tmp_path / "odd.gguf", "F32", arch="llama", rope_freqs=np.full(8, 2.0))
    with pytest.raises(ValueError, match="rope_freqs .* match no llama3 rope scaling"):
        resolve_model(str(unknown), cache_dir=tmp_path / "cache")


def test_gguf_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    import transformers

    source = _train_tokenizer()
    config = transformers.Qwen2Config(**{**TINY_SHAPE, "vocab_size": 416})
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(config).eval()
    path = write_gguf(hf_model, tmp_path / "tiny-tok.Q8_0.gguf", "Q8_0", arch="qwen2", tokenizer=source)
    loaded = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32", quantization="none")
    tokenizer = loaded.tokenizer
    assert tokenizer is not None and (loaded.source.path / "tokenizer.json").is_file()
    assert tokenizer.encode(TEXT, add_special_tokens=False) == source.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(source.encode(TEXT)) == TEXT
    messages = [{"role": "user", "content": "hi"}]
    assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    # The end of turn (the file's eos) and <|endoftext|> both stop a generation.
    im_end, endoftext = source.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert {im_end, endoftext} <= set(loaded.config.eos_token_ids)
    # Served through LLM (its own memory service), the chat goes through the file's template.
    from compute_service import LLM

    prompt = source.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with LLM(model=str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32", quantization="none",
             kv_cache_bytes=4 << 20) as llm:
        output = llm.chat(messages, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert output.token_ids == hf_greedy(_hf_from_gguf(path), list(prompt), 6)


def test_gguf_conversion_is_cached_by_digest(make_tiny_model, tmp_path, monkeypatch):
    path = write_gguf(make_tiny_model("llama").hf_model, tmp_path / "m.Q8_0.gguf", "Q8_0", arch="llama")
    first = resolve_model(str(path), cache_dir=tmp_path / "cache")
    digest = gguf_file.file_sha256(path)
    assert first.was_converted and first.path.name == f"m.Q8_0-{digest[:12]}"
    assert json.loads((first.path / model_loader.MARKER_FILE).read_text())["sha256"] == digest
    # A second start neither hashes (the digest is remembered) nor converts.
    monkeypatch.setattr(model_loader, "file_sha256", lambda p: pytest.fail("hashed again"))
    monkeypatch.setattr(model_loader, "convert_gguf", lambda p, out: pytest.fail("converted again"))
    again = resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert again.path == first.path and not again.was_converted
    # A changed file (its mtime moves) is hashed again: a new digest, a new copy.
    monkeypatch.undo()
    write_gguf(make_tiny_model("llama").hf_model, path, "Q4_0", arch="llama")
    changed = resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert changed.was_converted and changed.path != first.path


def test_gguf_progress_lines_for_a_big_file(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(gguf_file, "PROGRESS_MIN_BYTES", 10)
    monkeypatch.setattr(gguf_file.log, "info", lambda event, **kw: events.append((event, kw["percent"])))
    clock = iter(range(0, 100, 6))
    progress = gguf_file._Progress("gguf_hashing", tmp_path / "x.gguf", 100, clock=lambda: next(clock))
    for _ in range(4):
        progress.advance(25)
    assert events == [("gguf_hashing", 25), ("gguf_hashing", 50), ("gguf_hashing", 75), ("gguf_hashing", 100)]


def test_gguf_unsupported_architecture_and_tensor_type_are_named(make_tiny_model, tmp_path):
    hf_model = make_tiny_model("llama").hf_model
    gemma = write_gguf(hf_model, tmp_path / "g.gguf", "F32", arch="gemma2")
    with pytest.raises(ValueError, match="architecture 'gemma2'; supported: llama, qwen2"):
        load_model(str(gemma), cache_dir=tmp_path / "cache", device="cpu", dtype="float32")
    # Q2_K blocks need rows of 256: the tiny model's rows are 64 wide, so write a wider one.
    import transformers

    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2))
    q2k = write_gguf(wide, tmp_path / "q2k.gguf", "F32", arch="llama",
                     tensor_types={"blk.0.ffn_up.weight": "Q2_K"})
    with pytest.raises(ValueError, match="tensor 'blk.0.ffn_up.weight' has type Q2_K; supported: F32, F16, BF16"):
        load_model(str(q2k), cache_dir=tmp_path / "cache", device="cpu", dtype="float32")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="is a file but not a GGUF file"):
        resolve_model(str(not_gguf), cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]  # nothing half-converted


def _compute_service_error(model: Path, tmp_path: Path) -> str:
    """`python -m compute_service --model <model>`'s stderr, once it exited 2 without a traceback."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "compute_service", "--model", str(model), "--cache-dir", str(tmp_path / "cache"),
         "--memory-socket", str(tmp_path / "none.sock"), "--listen", f"unix:{tmp_path / 'c.sock'}",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def test_compute_service_names_an_unsupported_gguf_without_a_traceback(make_tiny_model, tmp_path):
    """`python -m compute_service --model x.gguf` (and so `pagedserve up`) exits with one error line."""
    gemma = write_gguf(make_tiny_model("llama").hf_model, tmp_path / "g.gguf", "F32", arch="gemma2")
    assert "error: --model: GGUF file 'g.gguf' has architecture 'gemma2'" in _compute_service_error(gemma, tmp_path)


def _write_small_llama(path: Path, metadata: dict | None = None, *, skip: tuple[str, ...] = (),
                       num_layers: int = 2) -> Path:
    """A llama GGUF of zeros (hidden 64, 4 heads of 16, 2 KV heads, feed-forward 128, vocabulary 32),
    its metadata (keys after "llama.") overridden by `metadata`, each value written with its Python
    type (None: left out); the tensors in `skip` left out."""
    import gguf

    values = {"embedding_length": 64, "block_count": num_layers, "feed_forward_length": 128,
              "attention.head_count": 4, "attention.head_count_kv": 2, "context_length": 256, **(metadata or {})}
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in values.items():
        name = f"llama.{key}"
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, int):
            writer.add_uint64(name, value) if value >= 1 << 32 else writer.add_uint32(name, value)
    shapes = {"token_embd.weight": (32, 64), "output_norm.weight": (64,)}
    for layer in range(num_layers):
        shapes |= {f"blk.{layer}.{part}.weight": shape for part, shape in (
            ("attn_norm", (64,)), ("ffn_norm", (64,)), ("attn_q", (64, 64)), ("attn_k", (32, 64)),
            ("attn_v", (32, 64)), ("attn_output", (64, 64)), ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)),
            ("ffn_down", (64, 128)))}
    for name, shape in shapes.items():
        if name not in skip:
            writer.add_tensor(name, np.zeros(shape, np.float32))  # (out, in): ggml's order reversed
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _convert(path: Path) -> dict:
    out = path.with_suffix(".out")
    out.mkdir()
    gguf_file.convert_gguf(path, out)
    return json.loads((out / "config.json").read_text())


def test_gguf_sizes_come_from_the_tensors_and_a_huge_context_length_is_clipped(tmp_path):
    config = _convert(_write_small_llama(tmp_path / "ok.gguf", {"context_length": (1 << 32) - 1}))
    assert {k: config[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size")} == {
        "hidden_size": 64, "vocab_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
    assert config["max_position_embeddings"] == 1 << 20  # clipped to gguf_shapes.MAX_CONTEXT_LENGTH


@pytest.mark.parametrize(("metadata", "skip", "error"), [
    ({"attention.head_count": 0}, (), r"llama.attention.head_count must be an integer in \[1, 1024\], got 0"),
    ({"block_count": 1_000_000}, (), r"llama.block_count must be an integer in \[1, 1024\], got 1000000"),
    ({"block_count": 3}, (), "llama.block_count is 3, the tensors say 2"),
    ({"embedding_length": 128}, (), "llama.embedding_length is 128, the tensors say 64"),
    ({"block_count": "two"}, (), "llama.block_count must be an integer in .*, got 'two'"),
    ({"feed_forward_length": 128.0}, (), "llama.feed_forward_length must be an integer in .*, got 128.0"),
    ({"context_length": [256]}, (), r"llama.context_length must be an integer in .*, got \[256\]"),
    ({"attention.layer_norm_rms_epsilon": "small"}, (), "llama.attention.layer_norm_rms_epsilon must be a positive"),
    ({"attention.head_count": 8, "attention.key_length": 16}, (),
     r"tensor 'blk.0.attn_q.weight' has shape \(64, 64\), expected \(128, 64\)"),
    ({"attention.head_count_kv": 4}, (), r"tensor 'blk.0.attn_k.weight' has shape \(32, 64\), expected \(64, 64\)"),
    ({"attention.head_count_kv": 3}, (), "head_count \\(4\\) is not a multiple of llama.attention.head_count_kv"),
    ({"feed_forward_length": 100}, (), r"tensor 'blk.0.ffn_gate.weight' has shape \(128, 64\), expected \(100, 64\)"),
    ({"attention.key_length": 15}, (), "a head size of 15 .* is not a positive even number"),
    ({}, ("blk.1.ffn_up.weight",), "lacks tensor 'blk.1.ffn_up.weight'"),
    ({}, tuple(f"blk.0.{p}.weight" for p in gguf_file._LAYER_TENSORS), r"layers 0..1 expected, missing: \[0\]"),
    ({}, ("token_embd.weight",), "lacks a 2-D token_embd.weight"),
])
def test_gguf_metadata_that_the_tensors_contradict_is_refused_by_name(tmp_path, metadata, skip, error):
    with pytest.raises(ValueError, match=error):
        _convert(_write_small_llama(tmp_path / "bad.gguf", metadata, skip=skip))


def test_gguf_metadata_with_no_layers_is_refused(tmp_path):
    """The review's file: one 32x64 tensor, said to have a million layers."""
    with pytest.raises(ValueError, match=r"has no layer tensors \(blk.N.\*\)"):
        _convert(_write_small_llama(tmp_path / "huge.gguf", {"block_count": 1_000_000}, num_layers=0))


def test_compute_service_names_bad_gguf_metadata_without_a_traceback(tmp_path):
    """head_count 0 was a ZeroDivisionError's traceback."""
    bad = _write_small_llama(tmp_path / "zero.gguf", {"attention.head_count": 0})
    assert ("error: --model: GGUF file 'zero.gguf': llama.attention.head_count must be an integer"
            in _compute_service_error(bad, tmp_path))


def test_float32_copies_of_quantized_matrices_are_written_only_when_a_load_reads_them(make_tiny_model, tmp_path,
                                                                                       monkeypatch):
    path = write_gguf(make_tiny_model("llama").hf_model, tmp_path / "m.Q8_0.gguf", "Q8_0", arch="llama")
    source = resolve_model(str(path), cache_dir=tmp_path / "cache")
    directory = source.path
    assert source.gguf == path
    # The conversion holds the integers and the file's float tensors (norms) only.
    assert not list(directory.glob(f"{gguf_file.DEQUANTIZED_PREFIX}-*"))
    names = [name for name, _ in model_loader._iter_weights(directory)]
    assert names and all(name.endswith("norm.weight") for name in names), names
    # An interrupted write left a shard and no marker: a load does not read it, and the next write
    # replaces it.
    (directory / f"{gguf_file.DEQUANTIZED_PREFIX}-00009.safetensors").write_bytes(b"half a shard")
    assert [name for name, _ in model_loader._iter_weights(directory)] == names
    # reads floats
    loaded = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32", quantization="none")
    assert (directory / gguf_file.DEQUANTIZED_MARKER).is_file()
    assert not (directory / f"{gguf_file.DEQUANTIZED_PREFIX}-00009.safetensors").exists()
    assert loaded.model.quantization == "none"
    # Written once: the next float load reads them as they are.
    monkeypatch.setattr(model_loader, "write_dequantized", lambda *a: pytest.fail("written again"))
    again = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32", quantization="none")
    assert again.fingerprint == loaded.fingerprint


def test_a_write_without_room_is_refused_with_the_sizes_and_leaves_nothing(make_tiny_model, tmp_path, monkeypatch):
    import shutil

    path = write_gguf(make_tiny_model("llama").hf_model, tmp_path / "m.Q8_0.gguf", "Q8_0", arch="llama")
    cache = tmp_path / "cache"
    full = shutil.disk_usage(tmp_path)._replace(free=100 << 20)  # under the 256 MiB kept spare
    monkeypatch.setattr(gguf_file.shutil, "disk_usage", lambda directory: full)
    with pytest.raises(ValueError, match=r"converting m\.Q8_0\.gguf needs 2\d\d MiB free in .*, and 100 MiB are "
                                         r"free: free some space, or set PAGEDSERVE_CACHE_DIR"):
        resolve_model(str(path), cache_dir=cache)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    source = resolve_model(str(path), cache_dir=cache)
    monkeypatch.setattr(gguf_file.shutil, "disk_usage", lambda directory: full)
    with pytest.raises(ValueError, match=r"de-quantizing m\.Q8_0\.gguf to float32 needs 2\d\d MiB free"):
        load_model(str(path), cache_dir=cache, device="cpu", dtype="float32", quantization="none")
    assert not (source.path / gguf_file.DEQUANTIZED_MARKER).exists()
    assert not list(source.path.glob(f"{gguf_file.DEQUANTIZED_PREFIX}-*"))
