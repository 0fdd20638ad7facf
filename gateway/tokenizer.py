"""The model's tokenizer and chat template, fetched from a backend (the gateway has no model files).

``Info`` lists the tokenizer's files with their sha256; ``GetTokenizer`` streams them in chunks.
Each file is checked against both checksums before ``transformers`` loads it from a private
temporary directory, which is removed as soon as the tokenizer is in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.errors import InvalidArgument, echo


class ModelTokenizer:
    """Turns prompts and chats into token ids, the way the compute service's own ``LLM`` does.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer, or None for a model without one (then
            text cannot be tokenized: every prompt or chat is INVALID_ARGUMENT).
        info: the backend's Info (model name, limits, chat template).
    """

    def __init__(self, hf_tokenizer: Any | None, info: compute_pb2.InfoResponse) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.info = info
        if hf_tokenizer is not None and info.chat_template:
            hf_tokenizer.chat_template = info.chat_template

    @property
    def has_chat_template(self) -> bool:
        return self.hf_tokenizer is not None and bool(getattr(self.hf_tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a plain prompt (special tokens such as BOS added as the model expects)."""
        if self.hf_tokenizer is None:
            raise InvalidArgument(f"prompt: model {self.info.model_name!r} has no tokenizer")
        return list(self.hf_tokenizer.encode(prompt, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat through the chat template, with the generation prompt appended."""
        if not self.has_chat_template:
            raise InvalidArgument(f"messages: model {self.info.model_name!r} has no chat template; send a prompt")
        try:
            ids = self.hf_tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template itself raised (jinja's raise_exception: bad roles/order)
            # The template's message may quote the caller's content: echoed, cut short.
            raise InvalidArgument(f"messages: the chat template rejected them: {echo(str(exc), 200)}") from None
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``token_ids``."""
        if self.hf_tokenizer is None:
            return [str(t) for t in token_ids]
        return list(self.hf_tokenizer.convert_ids_to_tokens(list(token_ids)))


async def fetch_tokenizer(stub: compute_pb2_grpc.ComputeStub, info: compute_pb2.InfoResponse,
                          timeout_s: float = 120.0) -> ModelTokenizer:
    """Downloads, verifies and loads the tokenizer that ``info`` lists.

    Raises:
        RuntimeError: a file is missing, has the wrong size, or fails its checksum.
    """
    if not info.tokenizer_files:
        return ModelTokenizer(None, info)
    expected = {f.name: f for f in info.tokenizer_files}
    with tempfile.TemporaryDirectory(prefix="pagedserve-gateway-tok-") as directory:
        digests: dict[str, Any] = {}
        handles: dict[str, Any] = {}
        try:
            async for chunk in stub.GetTokenizer(compute_pb2.GetTokenizerRequest(), timeout=timeout_s):
                if chunk.name not in expected or Path(chunk.name).name != chunk.name:
                    raise RuntimeError(f"tokenizer file {chunk.name!r} is not one Info listed")
                if chunk.name not in handles:
                    handles[chunk.name] = open(Path(directory) / chunk.name, "wb")  # noqa: SIM115
                    digests[chunk.name] = hashlib.sha256()
                handles[chunk.name].seek(chunk.offset)
                handles[chunk.name].write(chunk.data)
                digests[chunk.name].update(chunk.data)
                if chunk.sha256 and chunk.sha256 != expected[chunk.name].sha256:
                    raise RuntimeError(f"tokenizer file {chunk.name}: streamed sha256 differs from Info's")
        finally:
            for handle in handles.values():
                handle.close()
        for name, meta in expected.items():
            path = Path(directory) / name
            if not path.exists():
                raise RuntimeError(f"tokenizer file {name} was listed but not sent")
            # Chunks arrive in order, so the running digest is the whole file's.
            if path.stat().st_size != meta.size or digests[name].hexdigest() != meta.sha256:
                raise RuntimeError(f"tokenizer file {name} failed its size or sha256 check")
        hf_tokenizer = await asyncio.to_thread(_load, Path(directory))
    return ModelTokenizer(hf_tokenizer, info)


def _load(directory: Path) -> Any:
    # The fast tokenizer class needs no torch; AutoTokenizer (which imports it) only when a model
    # ships a slow-only tokenizer.
    if (directory / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
