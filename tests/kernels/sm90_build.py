"""Build the Triton kernels for sm_90 (H100/H200) without a GPU; print resource usage as JSON.

Run as a script in a fresh process (test_triton_compile.py does): Triton's own library functions
(tl.max, tl.sum, ...) are wrapped for the interpreter when TRITON_INTERPRET=1 is set at import, and
then cannot be compiled, so this must not share a process with the interpreter tests.

Integer arguments get the divisibility-by-16 hint that the JIT gives real strides, so that the
build matches what a GPU run compiles (vectorised, pipelined loads). Uses the ptxas and cuobjdump
that ship with Triton.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve_kernels import triton_attention, triton_write_kv

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ALIGNED_INTS = {"head_dim", "split_len"}  # plus every stride_*: multiples of 16 elements in practice

# name: (dtype, BLOCK_Q, NUM_SPLITS, num_warps, BLOCK_N), GQA 4, head dim 128, block size 16, with
# the launcher's default tiles for each kind of batch.
ATTENTION_CASES = {
    "bf16-decode": ("bf16", 4, 1, 4, 64),
    "bf16-prefill": ("bf16", 16, 1, 8, 64),
    "bf16-decode-split": ("bf16", 4, 8, 4, 64),
    "fp32-prefill": ("fp32", 16, 1, 8, 32),
}


def build(kernel: triton.runtime.jit.JITFunction, types: dict[str, str], constexprs: dict, num_warps: int) -> dict:
    """Compile for sm_90; returns {"REG": n, "STACK": n, "LOCAL": n, "mma": bool, "vector_loads": bool}."""
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        signature[name] = types.get(name, "i32")
        if name.endswith("_ptr") or name.startswith("stride_") or name in ALIGNED_INTS:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "--dump-resource-usage", cubin.name],
                                capture_output=True, text=True, check=True).stdout
    usage = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", report)}
    ptx = compiled.asm["ptx"]
    return usage | {"mma": "mma" in ptx, "vector_loads": "ld.global.v4" in ptx or "cp.async" in ptx}


def main() -> int:
    results = {}
    for name, (dtype, block_q, num_splits, num_warps, block_n) in ATTENTION_CASES.items():
        types = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                 "out_ptr": "*fp32" if num_splits > 1 else f"*{dtype}", "lse_ptr": "*fp32", "scale_log2": "fp32"}
        constexprs = dict(BLOCK_SIZE=16, BLOCK_Q=block_q, G_PAD=4, BLOCK_N=block_n, D_PAD=128, B_PAD=64,
                          NUM_SPLITS=num_splits, IS_FP32=dtype == "fp32", UPCAST_DOT=False)
        results[name] = build(triton_attention._paged_attention_kernel, types, constexprs, num_warps)
    results["merge"] = build(triton_attention._merge_splits_kernel,
                             {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
                             dict(NUM_SPLITS=5, S_PAD=8, D_PAD=128), num_warps=4)
    results["write_kv"] = build(triton_write_kv._write_kv_kernel,
                                {name: "*bf16" for name in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
                                | {"slot_mapping_ptr": "*i64"},
                                dict(BLOCK_SIZE=16, H_PAD=8, D_PAD=128), num_warps=4)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
