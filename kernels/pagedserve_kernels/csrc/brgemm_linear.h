// The small-batch linear on AMX tiles: ATen's batch-reduce GEMM (`at::native::cpublas::brgemm`, oneDNN's
// ukernel), included by cpu_ops.cpp. y (M, N) = x (M, K) @ weight (N, K)^T + bias, bf16 in, float32
// accumulation, outputs float32 or rounded to bf16 once: the contract of small_linear_bf16.h, on
// another weight layout.
//
// Why: on a CPU with AMX-BF16 the small-batch kernel's AVX512-BF16 dot products fall behind the tiles
// from a few rows on (docs/benchmarks.md, "The AMX Xeon"), and oneDNN's packed matmul, as fast, rounds its outputs to
// bf16, where decode keeps float32 (the LM head's logits: near-ties flip greedy answers). Here a
// projection's weight is packed once into column blocks of kBlockN in the VNNI layout the tiles read
// (pairs of K interleaved: `cpublas::pack`), which replaces the plain copy the small-batch kernel
// would read (same bytes); each block's product for every row is one brgemm call into a float32
// scratch, so a call streams the weight from memory once, whatever M is.
//
// Only where `available()`: `cpublas::could_pack(kBFloat16)`, ATen's own test for the bf16 ukernel
// (elsewhere brgemm falls back to a slow reference loop), and only weights `packs` takes.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {
namespace brgemm_linear {

constexpr int64_t kBlockN = 64;  // output columns a packed block holds (four 16-column tiles)
constexpr int64_t kBlockM = 32;  // rows of x one brgemm call takes (two 16-row tiles)
constexpr int64_t kMinRows = 3;  // the fewest rows a brgemm call is given (see `linear`)

inline bool available() {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

// Whether `pack` takes a weight of N outputs and K inputs (else the caller keeps the plain weight).
inline bool packs(int64_t N, int64_t K) { return N > 0 && N % kBlockN == 0 && K > 0 && K % 2 == 0; }

// weight (N, K) bf16 -> (N / kBlockN, K / 2, kBlockN, 2) bf16: column blocks, pairs of K interleaved.
inline at::Tensor pack(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), blocks = N / kBlockN;
  at::Tensor transposed = weight.t().contiguous();  // (K, N)
  at::Tensor packed = at::empty({blocks, K / 2, kBlockN, 2}, weight.options());
  const c10::BFloat16* src = transposed.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = packed.data_ptr<c10::BFloat16>();
  for (int64_t b = 0; b < blocks; ++b) {
    at::native::cpublas::pack(K, kBlockN, N, kBlockN, at::kBFloat16, at::kBFloat16, src + b * kBlockN,
                              dst + b * K * kBlockN);
  }
  return packed;
}

// y (M, N) = x (M, K) bf16 @ weight^T (+ bias (N,) bf16), the weight as `pack` made it for N outputs
// (N a multiple of kBlockN, K even); float32 accumulation, outputs float32 or rounded to bf16 once.
template <typename TOut>
inline void linear(const c10::BFloat16* x, const c10::BFloat16* packed, const c10::BFloat16* bias, TOut* y,
                   int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / kBlockN;
  // Each thread a contiguous run of blocks: one stream through its share of the weight.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  // oneDNN's ukernel for one or two rows reads the weight at a third of the speed it does for three
  // (docs/benchmarks.md): a pass of fewer rows (all of a small M, or the last pass's tail) is multiplied
  // as kMinRows from a zero-padded copy, the extra rows dropped.
  const int64_t tail_m0 = M - M % kBlockM, tail_rows = M % kBlockM;
  std::vector<c10::BFloat16> tail;
  if (tail_rows > 0 && tail_rows < kMinRows) {
    tail.assign(kMinRows * K, c10::BFloat16(0.0f));
    std::copy(x + tail_m0 * K, x + M * K, tail.begin());
  }
  at::parallel_for(0, blocks, (blocks + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kBlockM * kBlockN];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockN;
      for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
        const int64_t rows = std::min(kBlockM, M - m0);
        const bool padded = rows < kMinRows;
        at::native::cpublas::brgemm(padded ? kMinRows : rows, kBlockN, K, K, kBlockN, kBlockN, false,
                                    padded ? tail.data() : x + m0 * K, packed + b * K * kBlockN, c, true);
        for (int64_t i = 0; i < rows; ++i) {
          TOut* out = y + (m0 + i) * N + n0;
          for (int64_t j = 0; j < kBlockN; ++j)
            out[j] = static_cast<TOut>(c[i * kBlockN + j] + (bias ? static_cast<float>(bias[n0 + j]) : 0.0f));
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace brgemm_linear
}  // namespace
