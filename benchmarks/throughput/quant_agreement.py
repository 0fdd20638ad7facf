"""Accuracy of the quantized weights: teacher-forced top-1 agreement and KL against the float32 model,
and perplexity in llama.cpp's own convention beside llama.cpp's figure for the same file.

The reference is our float32 model with every weight de-quantized (`--quantization none`: for a GGUF
file, exactly gguf's de-quantized values). Each variant (`--variants`: "bf16" = no quantization,
bf16 activations; "auto" = the file's own blocks kept quantized; "int8" / "int4" = quantized at load
from the de-quantized weights) runs bf16 activations, or int8 ones where the CPU has the int8 paths
and the load keeps them for that model (compute_service/model/activation_check.py; the JSON's
"int8_activations" says which). `--dtype float32` runs the variants as a float32 model instead
(the quantized weights multiplied exactly, by each activation as two int8 parts where the CPU has
AVX512-VNNI, "int8x2_activations", or widened): the weights' own error, without what the bf16 model
adds (its activations, K/V and attention, and on oneDNN's prompt path the weights rounded to bf16);
"bf16" is then the reference itself. The text (English, benchmarks/throughput/
realistic.py's) is cut into `--chunks` windows of `--ctx` tokens; each window is one prefill; every
position of its second half is scored, as `llama-perplexity` scores (the first half is context):
top-1 agreement with float32, mean KL(float32 || variant), and perplexity of the text's own next
tokens. With `--llama-perplexity PATH` llama.cpp's tool runs on the same text file and `--gguf`
(`-c ctx --chunks N`, two threads) and its final estimate is reported beside ours.

    python -m benchmarks.throughput.quant_agreement --model FILE.gguf [--variants bf16 auto int8 int4]
        [--ctx 512 --chunks 8] [--llama-perplexity path/to/llama-perplexity] [--step-tokens 16]
        [--dtype float32]

The last line is one JSON object: {"model", "positions", "dtype", "<variant>": {"top1_vs_fp32",
"kl_vs_fp32", "ppl"}, "fp32": {"ppl"}, "llama_cpp": {"ppl", "command"}}.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.cpu_info import cpu_name
from benchmarks.throughput.realistic import english_text
from compute_service.model.model_loader import load_model
from compute_service.model.teacher_forcing import window_logits
from pagedserve_kernels import quant


def scored(logits: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half's log-probabilities (positions first..T-2, llama-perplexity's) and next tokens."""
    first = len(ids) // 2
    return logits[first:-1].log_softmax(-1), torch.tensor(ids[first + 1:])


def llama_cpp_ppl(binary: Path, gguf: Path, text: str, ctx: int, chunks: int) -> dict:
    """llama.cpp's perplexity of `text` (its own tokenizer and convention) over `chunks` windows."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as handle:
        handle.write(text)
        handle.flush()
        command = [str(binary), "-m", str(gguf), "-f", handle.name, "-c", str(ctx), "--chunks", str(chunks),
                   "-t", "2", "-b", str(ctx)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if match is None:
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"llama-perplexity printed no estimate ({done.returncode}):\n{tail}")
    return {"ppl": float(match.group(1)), "command": " ".join(command)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file (or a Hugging Face directory)")
    parser.add_argument("--variants", nargs="+", default=["bf16", "auto", "int8", "int4"])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--llama-perplexity", type=Path, default=None)
    parser.add_argument("--step-tokens", type=int, default=0,
                        help="run the variants' windows in steps of this many tokens (16: the rows of a "
                             "16-sequence decode batch, which multiply int8 activations on CPUs with "
                             "AVX512-VNNI and no AMX); 0: one prefill a window")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the variants' activations (float32: the quantized weights' own error)")
    args = parser.parse_args(argv)
    if args.step_tokens < 0:
        parser.error(f"--step-tokens must be 0 or more, got {args.step_tokens}")
    text = english_text()
    reference = load_model(args.model, device="cpu", dtype="float32", quantization="none")
    ids = reference.tokenizer(text, add_special_tokens=False).input_ids
    windows = [ids[i * args.ctx:(i + 1) * args.ctx] for i in range(min(args.chunks, len(ids) // args.ctx))]
    ref = [scored(window_logits(reference.model, w), w) for w in windows]
    positions = sum(len(targets) for _, targets in ref)
    summary: dict = {"cpu": cpu_name(), "model": reference.config.name, "ctx": args.ctx, "windows": len(windows),
                     "positions": positions, "step_tokens": args.step_tokens, "dtype": args.dtype}
    nll = sum(-float(lp.gather(1, t[:, None]).sum()) for lp, t in ref)
    summary["fp32"] = {"ppl": round(math.exp(nll / positions), 4)}
    del reference
    for variant in args.variants:
        quantization = "none" if variant == "bf16" else variant
        model = load_model(args.model, device="cpu", dtype=args.dtype, quantization=quantization).model
        agree = kl = nll = 0.0
        for (ref_lp, targets), window in zip(ref, windows):
            lp, _ = scored(window_logits(model, window, args.step_tokens), window)
            agree += float((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
            kl += float((ref_lp.exp() * (ref_lp - lp)).sum())
            nll -= float(lp.gather(1, targets[:, None]).sum())
        # int8 activations: a quantized model at bf16 on a CPU with the int8 paths; at float32, each
        # activation as two int8 parts where the CPU has VNNI (else the weight widened); a float model never
        int8 = model.quantization != "none" and args.dtype == "bfloat16" and quant.vnni_rows() > 0
        split = model.quantization != "none" and args.dtype == "float32" and quant.float_vnni()
        summary[variant] = {"held": model.quantization, "int8_activations": int8, "int8x2_activations": split,
                            "top1_vs_fp32": round(agree / positions, 4),
                            "kl_vs_fp32": round(kl / positions, 5), "ppl": round(math.exp(nll / positions), 4)}
        print(f"{variant}: {summary[variant]}", flush=True)
        del model
    if args.llama_perplexity is not None:
        summary["llama_cpp"] = llama_cpp_ppl(args.llama_perplexity, Path(args.model), text, args.ctx, args.chunks)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
