"""A GGUF model's sizes, taken from its tensors and checked against its metadata.

Why the tensors first: the metadata is a list of claims that nothing in the file enforces (a file
with one 32x64 tensor may say ``block_count`` 1000000), while the tensors are what will be loaded.
So the hidden size and the vocabulary come from ``token_embd``'s shape, the layer count from the
``blk.N`` tensors present (layers 0..N-1, each with the same complete set), and what the tensors
cannot say alone (heads, head size, feed-forward size) is read from the metadata and checked
against every q/k/v/o/ffn shape. A metadata value of the wrong type (a string, a list, a float
where an integer belongs), not above zero, or past a sane bound is a ``ValueError`` naming its key,
as is a missing or misshapen tensor: the compute service prints that one line and exits 2, never a
traceback (a ZeroDivisionError or a reshape error deep in the conversion).

Why the context length is clipped rather than refused: it is a limit, not a shape; no weight
depends on it, and a file that claims more than ``MAX_CONTEXT_LENGTH`` (some write 2**32 - 1 for
"unbounded") is served correctly up to that bound. It is clipped, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

MAX_CONTEXT_LENGTH = 1 << 20
MAX_HIDDEN_SIZE = 1 << 16
MAX_VOCAB_SIZE = 1 << 22
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_INTERMEDIATE_SIZE = 1 << 20
# Every layer's weights (a llama or qwen2 block).
_LAYER_WEIGHTS = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                  "ffn_down")
_QKV = ("attn_q", "attn_k", "attn_v")


@dataclass(frozen=True)
class GgufShape:
    """The sizes of a model, each one checked against the tensors (the module docstring)."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int  # the file's context length, clipped to MAX_CONTEXT_LENGTH
    has_attention_bias: bool  # q/k/v (and for llama o) biases in every layer


class Metadata:
    """A GGUF file's metadata values, type- and range-checked, each error naming its key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.reader, self.path = reader, path

    def raw(self, key: str) -> Any:
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    def integer(self, key: str, default: int | None = None, *, low: int = 1, high: int) -> int | None:
        """``key``'s integer in [low, high]; ``default`` when absent."""
        value = self.raw(key)
        if value is None:
            return default
        if type(value) is not int or not low <= value <= high:  # bool, float, str, list refused
            raise ValueError(f"GGUF file {self.path.name!r}: {key} must be an integer in [{low}, {high}], "
                             f"got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        """``key``'s positive, finite real number; ``default`` when absent."""
        value = self.raw(key)
        if value is None:
            return default
        if type(value) not in (int, float) or not 0 < value < float("inf"):
            raise ValueError(f"GGUF file {self.path.name!r}: {key} must be a positive number, got {value!r}")
        return float(value)

    def string(self, key: str) -> str | None:
        value = self.raw(key)
        if value is not None and type(value) is not str:
            raise ValueError(f"GGUF file {self.path.name!r}: {key} must be a string, got {value!r}")
        return value


def gguf_shape(meta: Metadata, arch: str, tensors: dict[str, Any]) -> GgufShape:
    """The model's sizes (the module docstring says where each comes from).

    Args:
        meta: the file's metadata.
        arch: its architecture (llama.cpp's keys are ``<arch>.<key>``).
        tensors: GGUF tensor name -> the reader's tensor (``shape`` in ggml order: inner first).

    Raises:
        ValueError: a bad metadata value or a missing or misshapen tensor, named.
    """
    name = meta.path.name
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()}  # HF order
    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise ValueError(f"GGUF file {name!r} lacks a 2-D token_embd.weight (the vocabulary by the hidden size)")
    vocab, hidden = embed
    if not (1 <= vocab <= MAX_VOCAB_SIZE and 1 <= hidden <= MAX_HIDDEN_SIZE):
        raise ValueError(f"GGUF file {name!r}: token_embd.weight's shape {embed} is out of bounds")

    def agrees(key: str, value: int, high: int) -> None:
        claimed = meta.integer(f"{arch}.{key}", high=high)
        if claimed is not None and claimed != value:
            raise ValueError(f"GGUF file {name!r}: {arch}.{key} is {claimed}, the tensors say {value}")

    agrees("embedding_length", hidden, MAX_HIDDEN_SIZE)
    agrees("vocab_size", vocab, MAX_VOCAB_SIZE)
    num_layers = _num_layers(shapes, name)
    agrees("block_count", num_layers, MAX_LAYERS)
    num_heads = meta.integer(f"{arch}.attention.head_count", high=MAX_HEADS)
    ffn = meta.integer(f"{arch}.feed_forward_length", high=MAX_INTERMEDIATE_SIZE)
    if num_heads is None or ffn is None:
        raise ValueError(f"GGUF file {name!r} lacks {arch}.attention.head_count or {arch}.feed_forward_length")
    num_kv_heads = meta.integer(f"{arch}.attention.head_count_kv", num_heads, high=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"GGUF file {name!r}: {arch}.attention.head_count ({num_heads}) is not a multiple of "
                         f"{arch}.attention.head_count_kv ({num_kv_heads})")
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // num_heads, low=0, high=MAX_HEAD_DIM)
    if head_dim == 0 or head_dim % 2:  # rotary embeddings pair the dimensions
        raise ValueError(f"GGUF file {name!r}: a head size of {head_dim} (from {arch}.attention.key_length, "
                         f"else embedding_length / head_count) is not a positive even number")
    agrees("attention.value_length", head_dim, MAX_HEAD_DIM)
    context = meta.integer(f"{arch}.context_length", 2048, high=(1 << 64) - 1)
    if context > MAX_CONTEXT_LENGTH:
        log.warning("gguf_context_length_clipped", file=name, context_length=context, clipped_to=MAX_CONTEXT_LENGTH)
        context = MAX_CONTEXT_LENGTH
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    expected = {"attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
                "attn_q.weight": (q_rows, hidden), "attn_k.weight": (kv_rows, hidden),
                "attn_v.weight": (kv_rows, hidden), "attn_output.weight": (hidden, q_rows),
                "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
                "attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,),
                "attn_output.bias": (hidden,)}
    biases = {n.split(".", 2)[2] for n in shapes if n.startswith("blk.0.") and n.endswith(".bias")}
    required_biases = {f"{kind}.bias" for kind in (_QKV if arch == "qwen2" else (*_QKV, "attn_output"))}
    if arch == "qwen2" and biases != required_biases or arch == "llama" and biases not in (set(), required_biases):
        raise ValueError(f"GGUF file {name!r}: layer biases {sorted(biases)}; a {arch} model has "
                         f"{sorted(required_biases)}{'' if arch == 'qwen2' else ' or none'}")
    for layer in range(num_layers):
        for part in [f"{kind}.weight" for kind in _LAYER_WEIGHTS] + sorted(biases):
            _check(shapes, f"blk.{layer}.{part}", expected[part], name)
    _check(shapes, "output_norm.weight", (hidden,), name)
    if "output.weight" in shapes:
        _check(shapes, "output.weight", (vocab, hidden), name)
    return GgufShape(hidden, vocab, num_layers, num_heads, num_kv_heads, head_dim, ffn, context, bool(biases))


def _num_layers(shapes: dict[str, tuple[int, ...]], name: str) -> int:
    """The layer count from the ``blk.N`` tensors: 0..N-1, none missing (their parts: ``_check``)."""
    layers = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.")}
    if not layers:
        raise ValueError(f"GGUF file {name!r} has no layer tensors (blk.N.*)")
    if max(layers) >= MAX_LAYERS:
        raise ValueError(f"GGUF file {name!r} has a layer {max(layers)}; at most {MAX_LAYERS} layers are served")
    missing = sorted(set(range(max(layers) + 1)) - layers)
    if missing:
        raise ValueError(f"GGUF file {name!r}: layers 0..{max(layers)} expected, missing: {missing[:5]}")
    return len(layers)


def _check(shapes: dict[str, tuple[int, ...]], tensor: str, expected: tuple[int, ...], name: str) -> None:
    if tensor not in shapes:
        raise ValueError(f"GGUF file {name!r} lacks tensor {tensor!r}")
    if shapes[tensor] != expected:
        raise ValueError(f"GGUF file {name!r}: tensor {tensor!r} has shape {shapes[tensor]}, expected {expected} "
                         "(from token_embd and the head and feed-forward metadata)")
