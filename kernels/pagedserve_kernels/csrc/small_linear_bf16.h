// A bf16 linear for a few rows (decode: one row per running sequence), included by cpu_ops.cpp where
// the build has AVX512-BF16 (`__AVX512BF16__`). y (M, N) = x (M, K) @ weight (N, K)^T + bias, the
// weight in its plain row-major layout, float32 accumulation, each output rounded to bf16 once (as
// oneDNN's bf16 matmul does), or written as float32 (TOut = float: the LM head's logits).
//
// Why: at one to a few rows a linear only streams its weight from memory once, and that is a decode
// step's whole cost. Without AMX, oneDNN's packed matmul reads a weight at about half of what a core
// can read at one row (docs/benchmarks.md, "Figures behind the code's choices"): it is built for GEMM
// tiles, not for a row. Here each thread
// streams its own contiguous share of the weight's rows front to back and does one `vdpbf16ps` (32
// multiply-adds) per 64 bytes read and row of x, the rows of x staying in L1. Each output is a dot product over K in one order (16 lanes, then the lanes summed),
// so a row's result does not depend on M or on the thread count.

#pragma once

#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "claims.h"

namespace {
namespace bf16_rows {

constexpr int64_t kMaxRows = 4;    // rows of x a pass keeps in accumulators (kMaxRows x kWeightRows zmm)
constexpr int64_t kWeightRows = 4; // weight rows read together
// Weight rows a thread takes at least: below it the parallel region costs more than it saves.
constexpr int64_t kMinRowsPerThread = 64;
constexpr int64_t kPrefetch = 1024;  // bytes ahead of the weight's read position (16 lines)

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Outputs [n0, n0 + rows) of rows [m0, m0 + MR) of x, one weight row at a time: the weight is read
// front to back (one sequential stream, what the hardware prefetcher follows best; 4 rows read
// side by side ran slower), two accumulator chains per row of x (independent adds).
template <int MR, typename TOut>
inline void block(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias, TOut* y,
                  int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t rows) {
  const int64_t tail = K % 32;
  const __mmask32 mask = (__mmask32)((1ull << tail) - 1);
  for (int64_t n = n0; n < n0 + rows; ++n) {
    const c10::BFloat16* w = weight + n * K;
    __m512 acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      // The rows are contiguous: kPrefetch bytes ahead runs on into the next rows.
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetch + 64, _MM_HINT_T0);
      const __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 32);
      for (int i = 0; i < MR; ++i) {
        const c10::BFloat16* xr = x + (m0 + i) * K + k;
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], as_bh(_mm512_loadu_si512(xr)), as_bh(w0));
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], as_bh(_mm512_loadu_si512(xr + 32)), as_bh(w1));
      }
    }
    if (k + 32 <= K) {
      const __m512i w0 = _mm512_loadu_si512(w + k);
      for (int i = 0; i < MR; ++i)
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], as_bh(_mm512_loadu_si512(x + (m0 + i) * K + k)), as_bh(w0));
      k += 32;
    }
    if (tail) {  // the last K % 32 elements; masked-off lanes are zeros (an odd K pairs with 0)
      const __m512i w0 = _mm512_maskz_loadu_epi16(mask, w + k);
      for (int i = 0; i < MR; ++i)
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], as_bh(_mm512_maskz_loadu_epi16(mask, x + (m0 + i) * K + k)),
                                     as_bh(w0));
    }
    const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.0f;
    for (int i = 0; i < MR; ++i)
      y[(m0 + i) * N + n] = static_cast<TOut>(_mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) + b);
  }
}

// y (M, N) = x (M, K) @ weight (N, K)^T (+ bias (N,)), every pointer contiguous bf16; any M (passes of
// kMaxRows rows over a thread's weight rows, which stay in cache between passes when they are few).
template <typename TOut>
inline void linear(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias, TOut* y,
                   int64_t M, int64_t K, int64_t N) {
  const int64_t num_blocks = (N + kWeightRows - 1) / kWeightRows;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                  N / kMinRowsPerThread));
  // The weight's row blocks, claimed by the threads (claims.h): each streams long runs of its own
  // part of memory, and a preempted thread holds up the call by its last claim only.
  claims::Claims blocks_left(num_blocks, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    blocks_left.each([&](int64_t b) {
      const int64_t n0 = b * kWeightRows, rows = std::min(kWeightRows, N - n0);
      int64_t m0 = 0;  // passes of kMaxRows rows of x: the block's weight rows stay in L1 between them
      for (; m0 + kMaxRows <= M; m0 += kMaxRows) block<kMaxRows, TOut>(x, weight, bias, y, K, N, m0, n0, rows);
      switch (M - m0) {
        case 3: block<3, TOut>(x, weight, bias, y, K, N, m0, n0, rows); break;
        case 2: block<2, TOut>(x, weight, bias, y, K, N, m0, n0, rows); break;
        case 1: block<1, TOut>(x, weight, bias, y, K, N, m0, n0, rows); break;
        default: break;
      }
    });
  });
}

}  // namespace bf16_rows
}  // namespace
