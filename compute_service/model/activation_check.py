"""Whether a quantized model multiplies int8 activations: measured once at load, on the model itself.

On CPUs with AVX512-VNNI and no AMX, a quantized linear of 3 rows and more can quantize its bf16
activations to int8 (per row and 32 inputs, as llama.cpp does for every batch) and multiply integers:
~1.3x faster prompts on the 1.5B Q4_K_M model. What that costs in accuracy depends on the model: the
1.5B's mean KL against float32 goes from 0.00016 to 0.00047 (top-1 99.4% -> 98.8-99.3%), SmolLM2-135M's
from 0.00022 to 0.00296 (99.2% -> 97.8%), enough to flip the near-tie of "What is the capital of
France?" from "The capital of France is Paris." to "L'Étoile, ..." (llama.cpp gives the same wrong
answer from that file). So the load measures it: the model's logits over a fixed English passage with
int8 activations and with bf16 ones, one prefill each, and keeps int8 where their mean KL (past the
first SKIP_POSITIONS) is at most MAX_KL. The setting is process-wide
(pagedserve_kernels.quant.set_int8_activations): one model a compute process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from compute_service.model.teacher_forcing import window_logits

log = structlog.get_logger(__name__)

# Mean KL(bf16 activations || int8 activations) over the passage's scored positions above which int8
# stays off: the 1.5B Q4_K_M measures ~0.0005 there, SmolLM2's Q4_1 ~0.0027 (docs/benchmarks.md,
# "Quantized prompts on int8 tiles; int8 activations chosen model by model").
MAX_KL = 1e-3
MAX_TOKENS = 160  # the passage's tokens taken: more than the decode batches' 32 rows, one prefill
# The first positions are not scored: with little context their distributions are flat and move with
# any perturbation, in every model (KL 0.004-0.009 over the first 16 for both models above).
SKIP_POSITIONS = 16

PASSAGE = (
    "The old harbour town wakes slowly in winter. Before the shops open, the fishing boats come back "
    "with the tide, and the men carry their boxes up the stone steps to the market hall, where buyers "
    "from the inland restaurants have been waiting since five. The price of cod is set by noon. In the "
    "afternoon the light fades early over the water, the cafes fill with students from the technical "
    "college, and the ferry to the islands leaves twice, at two and at four, if the wind allows it. "
    "Most visitors come in summer, for the beaches and the festival, but the people who live here say "
    "the town is only itself in January, when the streets are empty and the lighthouse keeper still "
    "walks his dog along the sea wall every evening, whatever the weather."
)


@dataclass(frozen=True)
class ActivationCheck:
    """What the load measured and chose: int8 activations on or off, the mean KL, the positions scored."""

    is_int8: bool
    kl: float
    num_positions: int
    seconds: float


def choose_int8_activations(model: Any, tokenizer: Any) -> ActivationCheck | None:
    """Measure int8 against bf16 activations on `model` (a quantized CausalLM with bf16 activations on
    the CPU) and keep the faster where it agrees (mean KL <= MAX_KL). None, measuring nothing, where the
    model's activations are not bf16 (they never take the int8 paths), the CPU has no int8 path, or the
    passage cannot be read (no tokenizer; too few tokens): int8 activations then stay as the kernels
    default, on."""
    from pagedserve_kernels import quant

    if getattr(model, "dtype", None) != torch.bfloat16 or tokenizer is None:
        return None
    ids = list(tokenizer.encode(PASSAGE))[:MAX_TOKENS]
    if len(ids) <= SKIP_POSITIONS + 32 or not quant.set_int8_activations(True):  # 32: the decode batches' rows
        return None
    started = time.perf_counter()
    try:
        int8 = window_logits(model, ids).log_softmax(-1)[SKIP_POSITIONS:]
        quant.set_int8_activations(False)
        bf16 = window_logits(model, ids).log_softmax(-1)[SKIP_POSITIONS:]
    except BaseException:
        quant.set_int8_activations(True)  # the kernels' default, not a half-made choice
        raise
    finally:
        quant.release_scratch()  # this (loading) thread's: the engine's own thread releases its own
    kl = float((bf16.exp() * (bf16 - int8)).sum(-1).mean())
    on = kl <= MAX_KL
    quant.set_int8_activations(on)
    check = ActivationCheck(is_int8=on, kl=kl, num_positions=len(bf16), seconds=time.perf_counter() - started)
    log.info("int8_activations", on=on, kl=round(kl, 6), max_kl=MAX_KL, positions=len(bf16),
             seconds=round(check.seconds, 2))
    return check
