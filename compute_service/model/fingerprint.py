"""The identity of a model's weights, sent to the memory service at Attach (AttachRequest.model_fingerprint).

The memory service's KV tier (memory_service/tier) keeps blocks across restarts and shares them
between compute services, keyed by this fingerprint: K/V computed by one set of weights must never
be served to another, even under the same model name (a fine-tune saved over its base, a new
conversion). Hashing every byte would take seconds for a large model at each attach; instead the
fingerprint hashes the model's config (its repr: architecture, rope, dtype-independent settings)
and, for every parameter in name order, its name, shape, dtype and a strided sample of at most
``SAMPLE_ELEMENTS`` of its elements, spread over the whole tensor. A change of any architecture
setting, shape or dtype changes it; so does a retraining or a different random seed (every sampled
element changes). What it can miss: an edit confined to elements between the samples of every
tensor, which no real checkpoint change is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from compute_service.model.model_config import ModelConfig

SAMPLE_ELEMENTS = 4096  # sampled elements per tensor
FINGERPRINT_VERSION = 1


def weights_fingerprint(model: torch.nn.Module, config: ModelConfig,
                        extra: Iterable[tuple[str, torch.Tensor]] = ()) -> str:
    """A hex digest (64 characters) of the model's config and a sample of every parameter.

    Args:
        model: the loaded model (any device).
        config: its ModelConfig.
        extra: (name, tensor) pairs sampled after the parameters: weights the model holds outside
            them (a GGUF's quantized integers and scales, whose parameters are released).

    Returns:
        The fingerprint; equal for the same weights loaded again, in any process.
    """
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"v{FINGERPRINT_VERSION}|{config!r}".encode())
    with torch.no_grad():
        named = sorted(model.named_parameters(), key=lambda item: item[0])
        for name, param in [*named, *extra]:
            flat = param.detach().reshape(-1)
            stride = max(1, flat.numel() // SAMPLE_ELEMENTS)
            sample = flat[::stride][:SAMPLE_ELEMENTS].contiguous().cpu()
            digest.update(f"|{name}|{tuple(param.shape)}|{param.dtype}|".encode())
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
