"""A GGUF file (llama.cpp's format) as a Hugging Face directory that the loader reads like any other.

`inspect_gguf` checks a file before anything costly: its architecture must be one we run (llama, which
also covers Mistral and SmolLM files, or qwen2) and every tensor's type one of `SUPPORTED_TENSOR_TYPES`;
either failure is a `ValueError` naming the architecture, or the type and the first tensor that has it.
`convert_gguf` then writes the directory: config.json and generation_config.json from the file's
tensors and metadata (the sizes taken from the tensors, the metadata checked against them, before
anything is written: compute_service/model/gguf_shapes.py), the tokenizer (chat template included)
built by transformers from the file, and every weight de-quantized by the `gguf` package into
safetensors shards. The model loader caches that directory under
`<cache root>/models/<file stem>-<sha256 prefix>`, keyed by the file's sha256 (`file_sha256`), so
each file is converted once and a changed file is converted again.

What the conversion writes of the weights: the file's own quantization (`QUANTIZED_FILE`: each
quantized matrix's integers, per-group scales and mins, read from its blocks by
compute_service/model/gguf_quant.py, and `QUANTIZATION_INDEX` naming each one's type), which
`--quantization auto` serves as it is (the weights stay quantized in memory and are computed on),
and safetensors shards of the tensors the file holds in floats (F32, F16 and BF16, exactly as
stored: norms, biases, and any matrix the file left unquantized). The float32 copies of the quantized
matrices (`write_dequantized`, shards named `DEQUANTIZED_PREFIX`-*) are written only when a load
reads them: `--quantization none`, `int8` or `int4`, a device where the quantized kernels do not
run, or a plain checkpoint reader (vLLM in the benchmarks). They make "our float32" the exact
de-quantized model that accuracy is measured against; for a 1.1 GB Q4_K_M file of a 1.5B model they
are 7.1 GB, which a server at `auto` never reads, so it never writes them either. Both writers check
the free space first and refuse with what they need and where.

Why a list of tensor types rather than whatever `gguf` can de-quantize: the listed ones are those we
test (and the legacy Q4_1/Q5_0/Q5_1 blocks of the default model's and the 0.5B Qwen's files); the
others (Q2_K, Q3_K, the IQ and ternary types, MXFP4) would be served without a single test, and the
quantized kernels to come will cover a list, not "anything".

Two layout differences from a Hugging Face checkpoint, both undone here as transformers' own GGUF
loader does (`modeling_gguf_pytorch_utils.LlamaTensorProcessor`):
- llama.cpp's converter permutes the rows of a llama q and k projection (each head's rotary pairs
  interleaved rather than split in halves); qwen2 files are not permuted.
- An absent `output.weight` means a tied LM head (the embedding matrix is reused).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from compute_service.model.gguf_shapes import Metadata, gguf_shape
from pagedserve.paths import CACHE_DIR_ENV

log = structlog.get_logger(__name__)

GGUF_MAGIC = b"GGUF"
# general.architecture -> our model_type. A Mistral file says "llama" (llama.cpp runs it as one).
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_FLOAT_TYPES = ("F32", "F16", "BF16")  # written as they are; the others are kept quantized
# Bump when the converted layout changes, so that old copies are rebuilt rather than misread.
GGUF_CACHE_FORMAT = 7
# <hf name>.q, .scale, .min (and a K-quant's .scale_factor, .min_factor: its d and -dmin) of every
# quantized matrix, in safetensors format under a name that tools globbing "*.safetensors" for a
# checkpoint's weights (vLLM, transformers, our loader) pass over.
QUANTIZED_FILE = "quantized.pagedserve"
# The float32 copies of the quantized matrices (`write_dequantized`): shards DEQUANTIZED_PREFIX-00001...,
# then DEQUANTIZED_MARKER once all are written.
DEQUANTIZED_PREFIX = "model-dequantized"
DEQUANTIZED_MARKER = "dequantized.json"
# Free space kept beyond what a write needs (the page cache, logs, a neighbour's next file).
SPARE_BYTES = 256 << 20
QUANTIZATION_INDEX = "quantization.json"  # <hf name> -> {"type": "Q4_K", "bits": 4}
# A file this large says where its hashing and conversion stand (a log line every PROGRESS_EVERY_S).
PROGRESS_MIN_BYTES = 256 << 20
PROGRESS_EVERY_S = 5.0
_HASH_CHUNK = 8 << 20
_SHARD_BYTES = 2 << 30  # float32 bytes per safetensors shard: bounds the memory a conversion holds
# Stop tokens of chat models whose metadata names only one end token (ChatML's turn end, a document end).
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf_file(path: Path) -> bool:
    """A regular file that starts with GGUF's magic bytes (whatever its name)."""
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


@dataclass(frozen=True)
class GgufSummary:
    """What `inspect_gguf` found: the architecture, our model_type for it, the tensor count."""

    architecture: str
    model_type: str
    num_tensors: int


def inspect_gguf(path: Path) -> GgufSummary:
    """Check that `path` is a GGUF we can serve, reading only its header (memory-mapped).

    Raises:
        ValueError: not a readable GGUF, an architecture we do not run, or a tensor type we do not
            load, each named.
    """
    return _inspect(_reader(path), path)


def _inspect(reader: Any, path: Path) -> GgufSummary:
    architecture = Metadata(reader, path).string("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF file {path.name!r} has architecture {architecture!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"GGUF file {path.name!r}: tensor {tensor.name!r} has type {type_name}; "
                             f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
        if _hf_name(tensor.name) is None and tensor.name != "rope_freqs.weight":
            raise ValueError(f"GGUF file {path.name!r}: tensor {tensor.name!r} is not part of a {architecture} "
                             "model we run")
    return GgufSummary(architecture, SUPPORTED_ARCHITECTURES[architecture], len(reader.tensors))


def file_sha256(path: Path) -> str:
    """The file's sha256, read in chunks (never whole into memory), with progress lines for a big file."""
    digest = hashlib.sha256()
    progress = _Progress("gguf_hashing", path, path.stat().st_size)
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
            progress.advance(len(chunk))
    return digest.hexdigest()


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write `path` as a Hugging Face directory into `out_dir` (see the module docstring).

    Raises:
        ValueError: as `inspect_gguf`, or metadata that does not describe a model we run.
    """
    reader = _reader(path)
    summary = _inspect(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    meta = Metadata(reader, path)
    config = _hf_config(meta, summary, tensors)
    stop_token_ids = [meta.integer(f"tokenizer.ggml.{name}_token_id", low=0, high=config["vocab_size"] - 1)
                      for name in ("eot", "eom")]  # checked before anything is written
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = _save_tokenizer(reader, path, out_dir)
    generation = {"bos_token_id": config.get("bos_token_id"),
                  "eos_token_id": _stop_token_ids([config["eos_token_id"], *stop_token_ids], tokenizer)}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    permute = summary.architecture == "llama"
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    # About: the integers at a byte each with their scales and mins (1.5 bytes a weight), the floats as stored.
    check_free_space(out_dir, sum(int(t.n_elements) * 3 // 2 if t.tensor_type.name not in _FLOAT_TYPES
                                  else int(t.n_bytes) for t in reader.tensors), f"converting {path.name}")
    kept = _write_quantized(out_dir, reader.tensors, permute, heads, path)
    _write_shards(out_dir, _hf_tensors([t for t in reader.tensors if t.name not in kept], permute, heads, path))


def write_dequantized(path: Path, out_dir: Path) -> None:
    """Add to `out_dir` (a conversion of the GGUF file `path`) the float32 copies of the matrices it
    holds quantized, as safetensors shards (`DEQUANTIZED_PREFIX`), then `DEQUANTIZED_MARKER`. Shards
    left by an interrupted call are replaced; a failed call removes its own. Loaders read the shards
    only once the marker is there (`model_loader._weight_files`).

    Raises:
        ValueError: not enough free space (the size needed is named).
    """
    index = json.loads((out_dir / QUANTIZATION_INDEX).read_text())
    config = json.loads((out_dir / "config.json").read_text())
    reader = _reader(path)
    tensors = [t for t in reader.tensors if _hf_name(t.name) in index]
    _remove_dequantized(out_dir)  # an interrupted write's shards, before their space is counted
    check_free_space(out_dir, sum(4 * int(t.n_elements) for t in tensors), f"de-quantizing {path.name} to float32")
    permute = config["model_type"] == "llama"
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    try:
        _write_shards(out_dir, _hf_tensors(tensors, permute, heads, path), prefix=DEQUANTIZED_PREFIX)
    except BaseException:
        _remove_dequantized(out_dir)
        raise
    (out_dir / DEQUANTIZED_MARKER).write_text(json.dumps({"format": GGUF_CACHE_FORMAT, "tensors": len(tensors)}))


def _remove_dequantized(out_dir: Path) -> None:
    for shard in out_dir.glob(f"{DEQUANTIZED_PREFIX}-*"):
        shard.unlink()


def check_free_space(directory: Path, num_bytes: int, what: str) -> None:
    """Refuse, naming the sizes, to write `num_bytes` into `directory` without SPARE_BYTES to spare (a
    full disk midway would end in a library's traceback and a half-written file)."""
    free = shutil.disk_usage(directory).free
    if free < num_bytes + SPARE_BYTES:
        raise ValueError(f"{what} needs {_size(num_bytes + SPARE_BYTES)} free in {directory}, and {_size(free)} "
                         f"are free: free some space, or set {CACHE_DIR_ENV} to a directory with room")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def _write_quantized(out_dir: Path, tensors: list[Any], permute: bool, heads: dict[str, int], path: Path) -> set[str]:
    """The file's quantized matrices as integers, scales and mins (`QUANTIZED_FILE`, `QUANTIZATION_INDEX`),
    rows in Hugging Face's order; nothing for a file of float tensors. Returns their GGUF names."""
    from safetensors.torch import save_file

    from compute_service.model.gguf_quant import file_quantization

    progress = _Progress("gguf_reading_quantization", path, sum(int(t.n_bytes) for t in tensors))
    saved: dict[str, torch.Tensor] = {}
    index: dict[str, dict[str, Any]] = {}
    kept: set[str] = set()
    for tensor in tensors:
        name = _hf_name(tensor.name)
        quant = file_quantization(tensor) if name is not None else None
        progress.advance(int(tensor.n_bytes))
        if quant is None:
            continue
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        parts = {"q": quant.q, "scale": quant.scale, "min": quant.minimum, "scale_factor": quant.scale_factor,
                 "min_factor": quant.min_factor}
        for field, value in parts.items():
            if value is not None:
                saved[f"{name}.{field}"] = _unpermute_rotary(value, heads[kind]) if permute and kind in heads else value
        index[name] = {"type": quant.type_name, "bits": quant.bits}
        kept.add(tensor.name)
    if saved:
        save_file(saved, out_dir / QUANTIZED_FILE, metadata={"format": "pt"})
        (out_dir / QUANTIZATION_INDEX).write_text(json.dumps(index, indent=1))
    return kept


def _hf_tensors(tensors: list[Any], permute: bool, heads: dict[str, int], path: Path
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight, de-quantized one at a time, in file order."""
    from gguf.quants import dequantize

    progress = _Progress("gguf_converting", path, sum(int(t.n_bytes) for t in tensors))
    for tensor in tensors:
        name = _hf_name(tensor.name)
        if name is None:  # rope_freqs: checked against the config in _rope_scaling, not a weight
            progress.advance(int(tensor.n_bytes))
            continue
        type_name = tensor.tensor_type.name
        if type_name in ("F32", "F16"):  # kept exactly as stored (F16 stays half: no widening on disk)
            weight = torch.from_numpy(np.array(tensor.data))
        elif type_name == "BF16":
            weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).to(torch.bfloat16)
        else:
            weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
        # (out, in) for a matrix, (n,) for a norm or bias: numpy order is ggml's reversed.
        weight = weight.reshape(tuple(int(n) for n in reversed(tensor.shape.tolist())))
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if permute and kind in heads:
            weight = _unpermute_rotary(weight, heads[kind])
        progress.advance(int(tensor.n_bytes))
        yield name, weight


def _unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: in the file each head's rows are (D/2, 2) pairs
    interleaved; Hugging Face's rotary (rotate_half) wants (2, D/2) halves. Rows: (H * D, ...)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _hf_name(gguf_name: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def _write_shards(out_dir: Path, named: Iterator[tuple[str, torch.Tensor]], prefix: str = "model") -> None:
    """safetensors shards of at most ~_SHARD_BYTES, so a multi-GB model never sits whole in memory."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    num_bytes = 0
    index = 0

    def flush() -> None:
        nonlocal shard, num_bytes, index
        if shard:
            index += 1
            save_file(shard, out_dir / f"{prefix}-{index:05d}.safetensors", metadata={"format": "pt"})
            shard, num_bytes = {}, 0

    for name, tensor in named:
        shard[name] = tensor
        num_bytes += tensor.numel() * tensor.element_size()
        if num_bytes >= _SHARD_BYTES:
            flush()
    flush()


def _hf_config(meta: Metadata, summary: GgufSummary, tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from the file's tensors and metadata (llama.cpp's keys, `<architecture>.<key>`),
    every size checked (compute_service/model/gguf_shapes.py)."""
    arch, path = summary.architecture, meta.path
    shape = gguf_shape(meta, arch, tensors)
    head_dim = shape.head_dim
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": summary.model_type,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": shape.max_position,
        "rms_norm_eps": meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.number(f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.integer("tokenizer.ggml.bos_token_id", low=0, high=shape.vocab_size - 1),
        "eos_token_id": meta.integer("tokenizer.ggml.eos_token_id", low=0, high=shape.vocab_size - 1),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    else:
        # llama.cpp writes q/k/v/o biases only for a model with attention_bias.
        config["attention_bias"] = shape.has_attention_bias
    rope_dims = meta.integer(f"{arch}.rope.dimension_count", high=1 << 16)
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"GGUF file {path.name!r} uses partial rotary embeddings ({rope_dims} of {head_dim} dims), "
                         "which are not supported")
    scaling = _rope_scaling(meta, arch, config, tensors.get("rope_freqs.weight"))
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(meta: Metadata, arch: str, config: dict[str, Any], freqs: Any) -> dict[str, Any] | None:
    """Rope scaling from `<arch>.rope.scaling.*`, or Llama 3's, recognised from its `rope_freqs` tensor.

    llama.cpp stores Llama 3's scaling only as the per-frequency divisors it implies; we run the
    llama3 rule from its parameters, so the tensor must equal the rule's divisors for one of the
    published parameter sets (Llama 3.1: factor 8, Llama 3.2: 32), or the file is refused.
    """
    path = meta.path
    kind = meta.string(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"GGUF file {path.name!r} uses rope scaling {kind!r}; supported: linear, llama3")
        return {"rope_type": "linear", "factor": meta.number(f"{arch}.rope.scaling.factor", 1.0)}
    if freqs is None:
        return None
    divisors = torch.from_numpy(np.array(freqs.data, dtype=np.float32)).reshape(-1)
    for factor in (8.0, 16.0, 32.0, 4.0):
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
        expected = _llama3_divisors(config["rope_theta"], config["head_dim"], params)
        if expected.shape == divisors.shape and torch.allclose(expected, divisors, rtol=1e-3):
            return params
    raise ValueError(f"GGUF file {path.name!r} has rope_freqs (per-frequency rotary factors) that match no llama3 rope "
                     "scaling we know; they are not supported")


def _llama3_divisors(theta: float, head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """What llama.cpp's converter writes as rope_freqs for Llama 3 scaling: one divisor per frequency."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    original = params["original_max_position_embeddings"]
    low_wavelen = original / params["low_freq_factor"]
    high_wavelen = original / params["high_freq_factor"]
    smooth = (original / wavelen - params["low_freq_factor"]) / (params["high_freq_factor"] - params["low_freq_factor"])
    mid = 1 / ((1 - smooth) / params["factor"] + smooth)
    divisors = torch.where(wavelen < high_wavelen, 1.0, torch.where(wavelen > low_wavelen, params["factor"], mid))
    return divisors.float()


def _save_tokenizer(reader: Any, path: Path, out_dir: Path) -> Any | None:
    """The file's tokenizer (vocabulary, merges, special tokens, chat template) as transformers builds
    it, saved into `out_dir`; None for a file without one (served on token ids only)."""
    if _field(reader, "tokenizer.ggml.model") is None:
        log.warning("gguf_without_tokenizer", file=path.name)
        return None
    from transformers import AutoTokenizer  # tokenization code only

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _stop_token_ids(ids: list[int | None], tokenizer: Any | None) -> list[int]:
    """The file's end tokens (eos, eot, eom, checked), then the chat stop tokens its vocabulary has."""
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        ids += [vocab.get(token) for token in _STOP_TOKENS]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:  # a bad magic or version, a truncated file
        raise ValueError(f"{path.name!r} is not a readable GGUF file: {exc}") from None


def _field(reader: Any, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


class _Progress:
    """Progress lines of a long pass over a big file: one at most every PROGRESS_EVERY_S, none for a
    small file. Logged, so `pagedserve up` shows them while it waits for the compute service."""

    def __init__(self, event: str, path: Path, total_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.event, self.path, self.total_bytes, self.clock = event, path, total_bytes, clock
        self.done_bytes = 0
        self.started = self.last = clock()
        self.is_shown = total_bytes >= PROGRESS_MIN_BYTES

    def advance(self, num_bytes: int) -> None:
        self.done_bytes += num_bytes
        now = self.clock()
        if self.is_shown and (now - self.last >= PROGRESS_EVERY_S or self.done_bytes >= self.total_bytes):
            self.last = now
            log.info(self.event, file=self.path.name, percent=round(100 * self.done_bytes / self.total_bytes),
                     gib=round(self.done_bytes / 2**30, 2), seconds=round(now - self.started, 1))
