"""The kernels API the model calls: `plan_step` (a step's per-layer kernels), `linear`/`prepack`
(the projections), and the paged-attention pair `write_kv` / `paged_attention` (contract in
docs/design.md).

`plan_step` returns the fused CPU kernels where they apply (a CPU model in float32 or bfloat16, a
supported head size, the C++ extension built) and the PyTorch ops otherwise; `write_kv` and
`paged_attention` send CUDA tensors to the Triton kernels, anything else to the PyTorch reference.
Triton is imported on the first CUDA call only and the C++ extension on the first `plan_step`, so
importing this package stays cheap.

The import name is `pagedserve_kernels`, not `kernels`: Hugging Face's `kernels` distribution, a
dependency of transformers, owns that one (docs/design.md, "Names").
"""

import torch

from pagedserve_kernels.cpu_linear import (PACKED_DTYPES, keeps_plain, linear, linear_path, logits, prepack,
                                           small_rows, small_weight)
from pagedserve_kernels.cpu_linear import available as can_prepack
from pagedserve_kernels.reference import paged_attention_reference, write_kv_reference
from pagedserve_kernels.step import LayerStack, StepKernels, TorchStep

__all__ = ["PACKED_DTYPES", "LayerStack", "StepKernels", "can_prepack", "keeps_plain", "kernel_paths", "linear",
           "linear_path", "logits", "paged_attention", "plan_step", "prepack", "small_rows", "small_weight",
           "step_path", "write_kv"]


def plan_step(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              cu_seqlens_q: torch.Tensor, *, dtype: torch.dtype, head_dim: int) -> StepKernels:
    """The kernels every layer of one step runs, chosen once per step (see kernels/pagedserve_kernels/step.py).

    Args:
        slot_mapping, block_tables, seq_lens, cu_seqlens_q: the step's ForwardBatch index tensors.
        dtype: the model's (activations and KV pool); head_dim: its head size.
    """
    # Imported here: `python -m pagedserve_kernels.cpu_ops` (the image's build step) must not find the module
    # already imported by this package.
    from pagedserve_kernels.cpu_attention import CpuAttentionPlan

    plan = CpuAttentionPlan.build(slot_mapping, block_tables, seq_lens, cu_seqlens_q, dtype=dtype, head_dim=head_dim)
    if plan is not None:
        return plan
    return TorchStep(slot_mapping, block_tables, seq_lens, cu_seqlens_q)


def step_path(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Which kernels a model on `device` in `dtype` with heads of `head_dim` runs every step, for the
    compute service's Info and metrics (on CPU this loads the fused kernels, or builds them: call it at
    start).

    Returns:
        "triton" (CUDA: the Triton attention kernels); "fused-cpp LEVEL" (the C++ kernels, LEVEL the
        prebuilt x86-64 level or "native"); "torch-fallback" (the model is one they take, but they
        could not be loaded: logged at error level by kernels.cpu_ops, or turned off); "torch" (a
        dtype or head size they do not take).
    """
    from pagedserve_kernels import cpu_ops
    from pagedserve_kernels.cpu_attention import covers

    if device.type == "cuda":
        return "triton"
    if not covers(device, dtype, head_dim):
        return "torch"
    if cpu_ops.load() is None:
        return "torch-fallback"
    return f"fused-cpp {cpu_ops.level()}"


def kernel_paths(device: torch.device, dtype: torch.dtype, head_dim: int, quantization: str = "none",
                 group: int | None = None) -> dict[str, str]:
    """Which code each kernel of a step runs on this CPU, for Info's kernel_paths and the metrics (a
    benchmark's line can say what ran). Empty where the fused CPU kernels do not run (`step_path`).

    Keys: "attention" ("avx512-bf16", "avx512" or "portable": the instructions of paged_attention's
    build, for block sizes of 4 to 16 in steps of 4; others run the portable kernel; bf16 on an AMX
    CPU adds ", prompts>=64 amx-tiles": the prompts that take csrc/prefill_tiles.h, and where the build
    has AMX, the head dim is a multiple of 32 and `group` (query heads per KV head; None: any) is 3 to
    16, ", decode amx-tiles": the single-position decodes of csrc/decode_tiles.h), "linear"
    (`cpu_linear.linear_path`: the small-batch rows and their kernel, then oneDNN, on AMX tiles or not;
    for a model whose weights are kept quantized, `quant.path()` and the formats held, e.g.
    "quant amx-tiles Q4_K+Q6_K, rows>=192 onednn": prompt chunks multiply on oneDNN; without AMX, where
    the model keeps int8 activations (compute_service/model/activation_check.py), ", rows<=32
    avx512-vnni int8, rows>=33 avx512-vnni int8 tiles": decode batches past two rows and prompts
    multiply int8 activations, and oneDNN takes none; a float32 model's, "quant float32 split: ..."
    where each activation row multiplies as two, `quant.float_vnni`).
    """
    if not step_path(device, dtype, head_dim).startswith("fused-cpp"):
        return {}
    from pagedserve_kernels import cpu_ops

    ops = cpu_ops.load()
    attention = ops.attention_isa()
    if dtype == torch.bfloat16 and ops.prompt_tiles_min_tokens():
        attention += f", prompts>={ops.prompt_tiles_min_tokens()} amx-tiles"
    min_group = ops.decode_tiles_min_group() if dtype == torch.bfloat16 and head_dim % 32 == 0 else 0
    if min_group and (group is None or min_group <= group <= 16):
        attention += ", decode amx-tiles"
    if quantization != "none":
        from pagedserve_kernels import quant

        linear = f"{quant.path(dtype)} {quantization}"
        vnni = quant.vnni_rows() if dtype == torch.bfloat16 else 0
        if vnni:
            linear += f", rows<={vnni} avx512-vnni int8"
        tile_rows = quant.vnni_tile_rows() if dtype == torch.bfloat16 else 0
        if tile_rows:
            linear += f", rows>={tile_rows} avx512-vnni int8 tiles"
        rows = quant.onednn_rows() if dtype == torch.bfloat16 else 0
        if rows:
            linear += f", rows>={rows} onednn"
        return {"attention": attention, "linear": linear}
    return {"attention": attention, "linear": linear_path(dtype)}


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' K/V into the paged caches, in place.

    Args:
        key, value: (T, H_kv, D) K/V of the new tokens.
        k_cache, v_cache: (num_blocks, block_size, H_kv, D), last dim contiguous (views into the pool).
        slot_mapping: (T,) int32 or int64; slot = block_id * block_size + offset; -1 skips the token.
    Raises:
        ValueError: shapes, dtypes, devices or strides do not fit the contract.
    """
    if key.is_cuda:
        from pagedserve_kernels.triton_write_kv import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a packed batch of new tokens over their sequences' paged KV cache.

    Query token i of sequence b sits at absolute position `seq_lens[b] - q_len_b + i` and attends to
    every position up to its own: causal within the new tokens, full over the cached context. The
    new tokens' K/V must already be in the cache (call `write_kv` first).

    Args:
        query: (T, H_q, D) new tokens of B sequences, packed; H_q % H_kv == 0.
        k_cache, v_cache: (num_blocks, block_size, H_kv, D) the layer's caches.
        block_tables: (B, max_blocks_per_seq) int32, padded with 0 past each sequence's blocks.
        seq_lens: (B,) int32 context length of each sequence including its new tokens.
        cu_seqlens_q: (B + 1,) int32; new tokens of sequence b are query[cu[b]:cu[b+1]].
        scale: softmax scale, default 1/sqrt(D).
    Returns:
        (T, H_q, D) in the dtype of query.
    Raises:
        ValueError: shapes, dtypes, devices or strides do not fit the contract.
    """
    if query.is_cuda:
        from pagedserve_kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale)
    return paged_attention_reference(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale)
