"""What a gateway needs to serve a model without its files: limits, special ids, chat template, and
the tokenizer's files themselves (read once at start, so what Info lists is what GetTokenizer sends,
even if the directory changes later)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import pagedserve_kernels as kernels
from pagedserve.dtypes import dtype_name

from compute_service.model.model_loader import LoadedModel

# Everything AutoTokenizer.from_pretrained may read (fast or slow tokenizer, chat template files of
# newer transformers); config.json is left out: tokenizer_config.json names the tokenizer class.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
CHUNK_BYTES = 256 << 10


@dataclass(frozen=True)
class TokenizerFile:
    name: str
    data: bytes

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
        """(offset, data) pieces of at most ``chunk_bytes``; an empty file gives one empty piece."""
        for offset in range(0, max(len(self.data), 1), chunk_bytes):
            yield offset, self.data[offset : offset + chunk_bytes]


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    dtype: str
    device: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int  # -1 = none
    pad_token_id: int  # -1 = none
    chat_template: str
    tokenizer_files: tuple[TokenizerFile, ...]
    kernels: str  # what every step runs: kernels.step_path ("fused-cpp x86-64-v4", "torch-fallback", ...)
    hidden_size: int = 0  # an embedding's length (0: not known)
    kernel_paths: tuple[tuple[str, str], ...] = ()  # kernels.kernel_paths' (kernel, path) pairs: the code each runs


def model_info(loaded: LoadedModel, served_model_name: str | None = None) -> ModelInfo:
    """Describe ``loaded``; ``served_model_name`` overrides the model's own name.

    On CPU this loads (or builds, about a minute on a first start) the fused kernels: call it while
    starting, off the event loop."""
    config, tokenizer = loaded.config, loaded.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    files = tuple(
        TokenizerFile(name, (loaded.source.path / name).read_bytes())
        for name in TOKENIZER_FILE_NAMES
        if tokenizer is not None and (loaded.source.path / name).is_file()
    )
    return ModelInfo(
        model_name=served_model_name or config.name,
        max_model_len=config.max_position,
        dtype=dtype_name(loaded.model.dtype),
        device=str(loaded.model.device),
        vocab_size=config.vocab_size,
        eos_token_ids=tuple(config.eos_token_ids),
        bos_token_id=config.bos_token_id if config.bos_token_id is not None else -1,
        pad_token_id=pad if pad is not None else -1,
        chat_template=template if isinstance(template, str) else "",
        tokenizer_files=files,
        kernels=kernels.step_path(loaded.model.device, loaded.model.dtype, config.head_dim),
        hidden_size=config.hidden_size,
        kernel_paths=tuple(kernels.kernel_paths(loaded.model.device, loaded.model.dtype, config.head_dim,
                                                loaded.model.quantization,
                                                config.num_q_heads // config.num_kv_heads).items()),
    )
