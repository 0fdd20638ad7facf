"""bf16 accuracy on the default model: teacher-forced top-1 agreement with float32 and with transformers.

Over English text (benchmarks/throughput/realistic.py's), each passage runs through our model as a
prefill of its first half (the prompt-tile kernels), then one teacher-forced decode step per token
of its second half (the decode kernels); at every position the top-1 next token is compared with
transformers' on the whole passage, in bfloat16 and in float32. Prints one JSON line: the agreement
of ours-bf16 with float32 (ours and transformers': the goal, >= 99%), with transformers-bf16,
transformers' own bf16 against its fp32 (a plain bf16 forward), ours-fp32 with transformers-fp32,
and the count of non-finite logits. The default, 20 passages of 200 tokens, scores 2,000 positions
(about 4 minutes on 2 cores).

    python -m benchmarks.throughput.bf16_agreement [--passages 20] [--tokens 200]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from benchmarks.throughput.realistic import english_text
from compute_service.model.forward_batch import ForwardBatch
from compute_service.model.model_loader import load_model, resolve_model

BLOCK_SIZE = 16


def ours_top1(model, ids: list[int], split: int) -> tuple[torch.Tensor, int]:
    """Our top-1 after positions split-1 .. len(ids)-2, and the number of non-finite logits."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    pool = torch.zeros(model.config.kv_pool_shape(num_blocks, BLOCK_SIZE), dtype=model.dtype)
    table = list(range(num_blocks))
    batch = ForwardBatch.build([ids[:split]], [0], [table], BLOCK_SIZE)
    logits = [model(batch, pool)[0]]
    for pos in range(split, len(ids) - 1):
        logits.append(model(ForwardBatch.build([[ids[pos]]], [pos], [table], BLOCK_SIZE), pool)[0])
    stacked = torch.stack(logits)
    return stacked.argmax(-1), int((~torch.isfinite(stacked)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per passage (half prefill, half decode)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = resolve_model("default").path
    ours = {name: load_model("default", device="cpu", dtype=name) for name in ("bfloat16", "float32")}
    tokenizer = ours["float32"].tokenizer
    theirs = {name: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, name), local_files_only=True).eval()
              for name in ("bfloat16", "float32")}
    text_ids = tokenizer(english_text(), add_special_tokens=False).input_ids
    rng = random.Random(args.seed)
    counts = {"ours_bf16_vs_ours_fp32": 0, "ours_bf16_vs_hf_fp32": 0, "hf_bf16_vs_hf_fp32": 0,
              "ours_bf16_vs_hf_bf16": 0, "ours_fp32_vs_hf_fp32": 0}
    positions = non_finite = 0
    split = args.tokens // 2
    for _ in range(args.passages):
        start = rng.randrange(len(text_ids) - args.tokens)
        ids = text_ids[start:start + args.tokens]
        with torch.no_grad():
            hf = {name: m(torch.tensor([ids])).logits[0, split - 1:-1].float().argmax(-1) for name, m in theirs.items()}
        with torch.inference_mode():
            ours_bf16, bad = ours_top1(ours["bfloat16"].model, ids, split)
            ours_fp32, _ = ours_top1(ours["float32"].model, ids, split)
        non_finite += bad
        positions += len(ours_bf16)
        counts["ours_bf16_vs_ours_fp32"] += int((ours_bf16 == ours_fp32).sum())
        counts["ours_bf16_vs_hf_bf16"] += int((ours_bf16 == hf["bfloat16"]).sum())
        counts["ours_bf16_vs_hf_fp32"] += int((ours_bf16 == hf["float32"]).sum())
        counts["hf_bf16_vs_hf_fp32"] += int((hf["bfloat16"] == hf["float32"]).sum())
        counts["ours_fp32_vs_hf_fp32"] += int((ours_fp32 == hf["float32"]).sum())
    print(json.dumps({"model": ours["float32"].config.name, "positions": positions, "non_finite_logits": non_finite,
                      **{k: round(v / positions, 4) for k, v in counts.items()}}))


if __name__ == "__main__":
    main()
