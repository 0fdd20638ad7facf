// AVX-512 paged attention (float32 or bfloat16 query, K/V and output; float32 arithmetic), included by
// cpu_ops.cpp where __AVX512F__ is defined; the portable omp-simd version there is the fallback
// (x86-64-v3 builds, other CPUs). Same contract.
//
// bfloat16 K/V where the build has AVX512-BF16 (`__AVX512BF16__`: -march=native on Zen 4, Sapphire
// Rapids, Cooper Lake): `vdpbf16ps` multiplies pairs of bf16 into float32 accumulators, so K (and in
// decode V too) is read in place, in its storage format, and each instruction does two
// multiply-adds (decode_block_pairs, scores_pairs below; faster than widening: docs/benchmarks.md,
// "Figures behind the code's choices"). Elsewhere (x86-64-v4 builds, no AVX512-BF16) each block is widened to float32 once
// (a bf16 is the top half of a float32: a 16-bit shift) into a per-thread scratch that stays in L1,
// and the float32 micro-kernels below run on it unchanged: a decode item widens the whole block (all
// KV heads, one contiguous run) and prefetches the next block's lines as it goes; a tile item widens
// its head's rows. Widening once per block beats widening at every use: the decode kernel reads each
// K row once per query head of the group, and the tile kernel broadcasts K element by element.
//
// Two micro-kernels, both one K/V block (block_size <= 16 tokens) of one KV head at a time:
//  - decode rows (1-4 query positions x the G heads of a KV head): a row's 16 scores are 16 dot
//    products reduced at once by a transpose-add tree into one zmm (tokens in lanes), so the online
//    softmax of a block is a handful of vector ops per row. One work item is a whole sequence (all
//    KV heads: a block's K, then V, are read as one contiguous run), or a slice of its blocks when
//    there are too few sequences to keep the threads busy (partials merged afterwards, like
//    flash-decoding).
//  - tile rows (prompt chunks, fresh prompts: up to 48 rows = query positions x G heads): the
//    scores are computed transposed, S^T (tokens x rows), from a transposed copy of the tile's
//    queries made once per item, with a register block of 8 tokens x 48 rows; rows sit in lanes,
//    so the softmax's max and sum over tokens are vertical ops and the causal mask is a compare.
// P @ V is common: per token, the V row (D/16 zmm) times each row's weight, 24 zmm accumulators.
// Work items are taken from a shared counter, longest first (contexts differ a lot in a batch).

#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "brgemm_linear.h"  // the prompt tiles (prefill_tiles.h, included below) call brgemm
#include "amx_tiles.h"      // the decode tiles (decode_tiles.h) program the tile registers

namespace {
namespace avx512_attention {

// Tokens of a block in one zmm of scores, read 4 at a time: other block sizes run the portable path.
constexpr int64_t kMaxBlockSize = 16;
constexpr int64_t kTileRows = 48;      // rows of a tile item (3 zmm of lanes)
// Query positions that still take the decode kernel (speculative verification: a few positions
// over a long context read K/V once for all heads, as a decode does; longer chunks take tiles).
constexpr int64_t kDecodeMaxQ = 4;
// A decode item reads its blocks in a random order of the pool (4 KiB pages apart: the hardware
// prefetchers stop at each page), so it asks for them ahead itself: block blk + kFarBlocks into L2
// while block blk computes, spread over its KV heads, and the next block's rows of a head into L1 as
// that head's P @ V runs (`next_k`, `next_v`). On a 2-core Zen 4, L2 three blocks ahead took decode
// attention at 32 x 600 from 14.4 to 23 GB/s (median; 31 GB/s plain read), L1 alone, or L2 only,
// less (docs/benchmarks.md, "Decode attention asks for its blocks ahead").
constexpr int64_t kFarBlocks = 3;

// Prefetches lines [from, to) of a block's K and V runs into L2.
inline void prefetch_l2(const void* k, const void* v, int64_t from, int64_t to) {
  for (int64_t line = from; line < to; ++line) {
    _mm_prefetch(static_cast<const char*>(k) + 64 * line, _MM_HINT_T1);
    _mm_prefetch(static_cast<const char*>(v) + 64 * line, _MM_HINT_T1);
  }
}

// 16 elements as float32 lanes: a plain load, or 16 bfloat16 widened (shifted into the high half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// 16 float32 lanes stored as float32, or rounded to nearest-even bfloat16 (NaN kept a quiet NaN).
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
#ifdef __AVX512BF16__
  const __m256bh narrow = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(narrow));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}

// n rows of `width` (a multiple of 16) elements, `src_stride` apart, widened into dst (rows `width`
// apart). With `next`, prefetches the same extent of another run (the next block) line by line.
template <typename T>
inline void widen_rows(const T* src, int64_t src_stride, int64_t n, int64_t width, float* dst,
                       const T* next = nullptr) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < width; j += 16) {
      if (next != nullptr && (j * sizeof(T)) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(next + t * src_stride + j), _MM_HINT_T0);
      _mm512_storeu_ps(dst + t * width + j, load16(src + t * src_stride + j));
    }
  }
}

inline __m512 exp512(__m512 x) {  // the Cephes polynomial of exp_approx, 16 lanes at once
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, z, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);  // y * 2^fx
}

// v[t] (16 partial dot products each) -> one zmm whose lane t is the sum of v[t]'s lanes.
inline __m512 transpose_add16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 32-bit pairs within 128-bit lanes
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 64-bit pairs: each 128-bit lane holds 4 tokens' partial sums
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes, pairwise
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// acc[r] = acc[r] * corr[r] + sum_t p(r, t) v[t] for rows r < num_rows (p(r, t) = p[t * t_stride + r * r_stride]).
// With next_k/next_v, also prefetches the next block's rows of this head, a token per step, so
// that the loads of the next block spread over this one's arithmetic instead of queueing at once.
template <int64_t D>
inline void weighted_values(const float* p, int64_t t_stride, int64_t r_stride, const float* corr, int64_t num_rows,
                            const float* v, int64_t v_stride, int64_t n, float* acc, const float* next_k = nullptr,
                            const float* next_v = nullptr, int64_t next_n = 0) {
  constexpr int64_t DV = D / 16, RB = 24 / DV;  // 24 accumulators
  for (int64_t r0 = 0; r0 < num_rows; r0 += RB) {
    const int64_t nr = std::min(RB, num_rows - r0);
    __m512 o[RB][DV];
    for (int64_t i = 0; i < RB; ++i) {
      if (i >= nr) break;
      const __m512 c = _mm512_set1_ps(corr[r0 + i]);
      for (int64_t j = 0; j < DV; ++j) o[i][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * D + 16 * j), c);
    }
    for (int64_t t = 0; t < n; ++t) {
      if (next_k != nullptr && r0 == 0 && t < next_n) {
        for (int64_t j = 0; j < D; j += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(next_k + t * v_stride + j), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next_v + t * v_stride + j), _MM_HINT_T0);
        }
      }
      __m512 vt[DV];
      for (int64_t j = 0; j < DV; ++j) vt[j] = _mm512_loadu_ps(v + t * v_stride + 16 * j);
      const float* pt = p + t * t_stride + r0 * r_stride;
      for (int64_t i = 0; i < RB; ++i) {
        if (i >= nr) break;
        const __m512 w = _mm512_set1_ps(pt[i * r_stride]);
        for (int64_t j = 0; j < DV; ++j) o[i][j] = _mm512_fmadd_ps(w, vt[j], o[i][j]);
      }
    }
    for (int64_t i = 0; i < RB; ++i) {
      if (i >= nr) break;
      for (int64_t j = 0; j < DV; ++j) _mm512_storeu_ps(acc + (r0 + i) * D + 16 * j, o[i][j]);
    }
  }
}

// Decode rows: q (num_rows, D) pre-scaled; row r sees min(n, first_row_visible + r / group) tokens of
// the block (a few query positions x heads, as in speculative verification; kFull: every row sees
// all 16). m: running max per row; l: (num_rows, 16) running sums per row, lane-wise (added up at
// the end); p: (num_rows, 16) scratch; corr: (num_rows,) scratch.
template <int64_t D, bool kFull>
inline void decode_block(const float* q, int64_t num_rows, const float* k, const float* v, int64_t stride, int64_t n,
                         int64_t first_row_visible, int64_t group, float* m, float* l, float* acc, float* p,
                         float* corr, const float* next_k, const float* next_v, int64_t next_n) {
  constexpr int64_t DV = D / 16;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t seen = kFull ? 16 : std::min(n, first_row_visible + r / group);
    if (!kFull && seen <= 0) {  // a later query position's token: no weight, state unchanged
      corr[r] = 1.0f;
      _mm512_storeu_ps(p + r * 16, _mm512_setzero_ps());
      continue;
    }
    const __mmask16 valid = kFull ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << seen) - 1);
    __m512 qv[DV];
    for (int64_t j = 0; j < DV; ++j) qv[j] = _mm512_loadu_ps(q + r * D + 16 * j);
    __m512 part[16];
    for (int64_t t = 0; t < 16; ++t) {
      if (kFull || t < seen) {
        const float* kt = k + t * stride;
        __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
        for (int64_t j = 1; j < DV; ++j) s = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kt + 16 * j), s);
        part[t] = s;
      } else {
        part[t] = _mm512_setzero_ps();
      }
    }
    __m512 s = transpose_add16(part);
    if (!kFull) s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s);
    const __m512 old_max = _mm512_set1_ps(m[r]);
    const __m512 new_max = _mm512_max_ps(old_max, _mm512_set1_ps(_mm512_reduce_max_ps(s)));
    __m512 e = exp512(_mm512_sub_ps(s, new_max));
    if (!kFull) e = _mm512_maskz_mov_ps(valid, e);
    // exp of (old max - new max): ~0 on the first block (old max -inf), 1 while the max holds.
    const __m512 c = exp512(_mm512_sub_ps(old_max, new_max));
    corr[r] = _mm512_cvtss_f32(c);
    m[r] = _mm512_cvtss_f32(new_max);
    _mm512_storeu_ps(l + r * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + r * 16), c, e));
    _mm512_storeu_ps(p + r * 16, e);
  }
  weighted_values<D>(p, 1, 16, corr, num_rows, v, stride, n, acc, next_k, next_v, next_n);
}

// st[t][rows] = sum_d k[t][d] qt[d][rows] for NT tokens: NT x RV accumulators stay in registers
// (one small array per token: GCC keeps those in registers, a single NT x RV array it spilled).
template <int64_t D, int64_t RV, int64_t NT>
inline void scores_transposed(const float* qt, const float* k, int64_t stride, float* st) {
  constexpr int64_t RP = RV * 16;
  static_assert(NT == 4 || NT == 8, "4 or 8 tokens");
  __m512 a0[RV], a1[RV], a2[RV], a3[RV], a4[RV], a5[RV], a6[RV], a7[RV];
  for (int64_t j = 0; j < RV; ++j) {
    a0[j] = a1[j] = a2[j] = a3[j] = _mm512_setzero_ps();
    if (NT == 8) a4[j] = a5[j] = a6[j] = a7[j] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; ++d) {
    __m512 qd[RV];
    for (int64_t j = 0; j < RV; ++j) qd[j] = _mm512_loadu_ps(qt + d * RP + 16 * j);
#define PS_TOKEN(T, A)                                                                 \
  {                                                                                    \
    const __m512 kd = _mm512_set1_ps(k[(T) * stride + d]);                             \
    for (int64_t j = 0; j < RV; ++j) A[j] = _mm512_fmadd_ps(kd, qd[j], A[j]);          \
  }
    PS_TOKEN(0, a0) PS_TOKEN(1, a1) PS_TOKEN(2, a2) PS_TOKEN(3, a3)
    if (NT == 8) { PS_TOKEN(4, a4) PS_TOKEN(5, a5) PS_TOKEN(6, a6) PS_TOKEN(7, a7) }
#undef PS_TOKEN
  }
  for (int64_t j = 0; j < RV; ++j) {
    _mm512_storeu_ps(st + 0 * RP + 16 * j, a0[j]);
    _mm512_storeu_ps(st + 1 * RP + 16 * j, a1[j]);
    _mm512_storeu_ps(st + 2 * RP + 16 * j, a2[j]);
    _mm512_storeu_ps(st + 3 * RP + 16 * j, a3[j]);
    if (NT == 8) {
      _mm512_storeu_ps(st + 4 * RP + 16 * j, a4[j]);
      _mm512_storeu_ps(st + 5 * RP + 16 * j, a5[j]);
      _mm512_storeu_ps(st + 6 * RP + 16 * j, a6[j]);
      _mm512_storeu_ps(st + 7 * RP + 16 * j, a7[j]);
    }
  }
}

// Tile rows: qt (D, RV * 16) the rows' queries transposed and pre-scaled; row r sees
// limit[r] = first_row_visible + r / group tokens of this block (masked lanes: no weight);
// n_all = the most any row sees (<= block size). st: (16, RV * 16) scratch; corr: (RV * 16,).
// k == nullptr: st holds the block's scores already (bf16 pairs: tile_scores_pairs); stride is V's.
template <int64_t D, int64_t RV, bool kMasked>
inline void tile_block(const float* qt, const __m512i* limit, int64_t num_rows, const float* k, const float* v,
                       int64_t stride, int64_t n_all, float* m, float* l, float* acc, float* st, float* corr) {
  constexpr int64_t RP = RV * 16;
  for (int64_t t0 = 0; k != nullptr && t0 < n_all; t0 += 8) {  // S^T, 8 tokens x RV zmm of rows in registers
    const int64_t nt = std::min<int64_t>(8, n_all - t0);
    if (nt == 8) {
      scores_transposed<D, RV, 8>(qt, k + t0 * stride, stride, st + t0 * RP);
    } else {
      scores_transposed<D, RV, 4>(qt, k + t0 * stride, stride, st + t0 * RP);  // tokens past n_all: masked below
      if (nt > 4) scores_transposed<D, RV, 4>(qt, k + (t0 + 4) * stride, stride, st + (t0 + 4) * RP);
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < RV; ++j) {
    __m512 block_max = neg_inf;
    for (int64_t t = 0; t < n_all; ++t) {
      const __m512 x = _mm512_loadu_ps(st + t * RP + 16 * j);
      if (kMasked) {
        const __mmask16 seen = _mm512_cmpgt_epi32_mask(limit[j], _mm512_set1_epi32(static_cast<int>(t)));
        block_max = _mm512_mask_max_ps(block_max, seen, block_max, x);
      } else {
        block_max = _mm512_max_ps(block_max, x);
      }
    }
    // A row that sees nothing of this block keeps its max (it saw block 0, so the max is finite).
    const __m512 old_max = _mm512_loadu_ps(m + 16 * j);
    const __m512 new_max = _mm512_max_ps(old_max, block_max);
    const __m512 c = exp512(_mm512_sub_ps(old_max, new_max));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l + 16 * j), c);
    for (int64_t t = 0; t < n_all; ++t) {
      __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(st + t * RP + 16 * j), new_max));
      if (kMasked) {
        e = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(limit[j], _mm512_set1_epi32(static_cast<int>(t))), e);
      }
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(st + t * RP + 16 * j, e);
    }
    _mm512_storeu_ps(m + 16 * j, new_max);
    _mm512_storeu_ps(l + 16 * j, sum);
    _mm512_storeu_ps(corr + 16 * j, c);
  }
  weighted_values<D>(st, RP, 1, corr, num_rows, v, stride, n_all, acc);
}

#ifdef __AVX512BF16__
// bfloat16 decode with `vdpbf16ps` (AVX512-BF16): each instruction multiplies 16 pairs of bf16 and
// adds both products to a float32 lane, so K and V are read in their storage format (no widening
// pass) and each instruction does two multiply-adds. Scores: a pair is two consecutive elements of
// a row, q (bf16, as the model made it) against the K row in place, scaled afterwards in float32.
// P @ V: a pair is two consecutive tokens, (p_t, p_t+1) against (v_t[d], v_t+1[d]). A weight in
// bf16 alone would be off by up to 2^-9 of itself (PyTorch's CPU flash attention takes that: its
// P @ V is a bf16 GEMM), which on a short context moves the output by more than the float32
// reference's tolerance; so each weight is split in two bf16, p = hi + lo (hi = bf16(p),
// lo = bf16(p - hi), together within 2^-17 of p), and both halves are multiplied: two instructions
// per pair of tokens and 32 elements, still half the arithmetic of widening V to float32 and one FMA
// per element. unpacklo/hi_epi16 of two V rows make the pairs within 128-bit lanes: the lo half holds elements
// 8L..8L+3 of lane L, the hi half 8L+4..8L+7; the accumulators keep that order (`kPairOrder`) until
// `unpermute_pairs` puts them back. Needs D % 32 == 0 (a row is whole zmm of 32 bf16).
constexpr bool kPairs = true;

// acc (rows x D) from the pair order back to element order, in place.
template <int64_t D>
inline void unpermute_pairs(float* acc, int64_t rows) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < D; j += 32) {
      const __m512 lo = _mm512_loadu_ps(acc + r * D + j), hi = _mm512_loadu_ps(acc + r * D + j + 16);
      _mm512_storeu_ps(acc + r * D + j, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(acc + r * D + j + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
  }
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// One block of one KV head for the decode rows, bf16 K/V in place (see decode_block for the rows,
// m, l and corr). q: (num_rows, D) bf16, not scaled; pw: (num_rows, 16) scratch, each row's 16
// weights as 8 bf16 pairs of their high halves, then 8 of their low halves; acc in the pair order. next_k/next_v: this head's rows of the next block.
template <int64_t D, bool kFull>
inline void decode_block_pairs(const c10::BFloat16* q, int64_t num_rows, const c10::BFloat16* k,
                               const c10::BFloat16* v, int64_t stride, int64_t n, int64_t first_row_visible,
                               int64_t group, float scale, float* m, float* l, float* acc, uint32_t* pw,
                               float* corr, const c10::BFloat16* next_k, const c10::BFloat16* next_v,
                               int64_t next_n) {
  constexpr int64_t DW = D / 32;  // zmm of 32 bf16 per row
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t seen = kFull ? 16 : std::min(n, first_row_visible + r / group);
    if (!kFull && seen <= 0) {  // a later query position's token: no weight, state unchanged
      corr[r] = 1.0f;
      std::fill(pw + r * 16, pw + r * 16 + 16, 0u);
      continue;
    }
    const __mmask16 valid = kFull ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << seen) - 1);
    __m512i qv[DW];
    for (int64_t j = 0; j < DW; ++j) qv[j] = _mm512_loadu_si512(q + r * D + 32 * j);
    __m512 part[16];
    for (int64_t t = 0; t < 16; ++t) {
      if (kFull || t < seen) {
        const c10::BFloat16* kt = k + t * stride;
        __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(qv[0]), as_bh(_mm512_loadu_si512(kt)));
        for (int64_t j = 1; j < DW; ++j) s = _mm512_dpbf16_ps(s, as_bh(qv[j]), as_bh(_mm512_loadu_si512(kt + 32 * j)));
        part[t] = s;
      } else {
        part[t] = _mm512_setzero_ps();
      }
    }
    __m512 s = _mm512_mul_ps(transpose_add16(part), vscale);
    if (!kFull) s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s);
    const __m512 old_max = _mm512_set1_ps(m[r]);
    const __m512 new_max = _mm512_max_ps(old_max, _mm512_set1_ps(_mm512_reduce_max_ps(s)));
    __m512 e = exp512(_mm512_sub_ps(s, new_max));
    if (!kFull) e = _mm512_maskz_mov_ps(valid, e);
    const __m256bh hi = _mm512_cvtneps_pbh(e);  // e = hi + lo, each a bf16
    const __m512 hi_wide = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hi)), 16));
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, hi_wide));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + r * 16), reinterpret_cast<const __m256i&>(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + r * 16 + 8), reinterpret_cast<const __m256i&>(lo));
    // The running max rarely moves once a few blocks are in: then nothing is rescaled (exp(0) = 1).
    const float max_now = _mm512_cvtss_f32(new_max);
    if (max_now == m[r]) {
      corr[r] = 1.0f;
      _mm512_storeu_ps(l + r * 16, _mm512_add_ps(_mm512_loadu_ps(l + r * 16), e));
    } else {
      const __m512 c = exp512(_mm512_sub_ps(old_max, new_max));
      corr[r] = _mm512_cvtss_f32(c);
      _mm512_storeu_ps(l + r * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + r * 16), c, e));
    }
    m[r] = max_now;
  }
  // P @ V: RB rows x 2 DW accumulators (24 at most), a pair of tokens per step.
  constexpr int64_t RB = 24 / (2 * DW);
  for (int64_t r0 = 0; r0 < num_rows; r0 += RB) {
    const int64_t nr = std::min(RB, num_rows - r0);
    __m512 o[RB][2 * DW];
    for (int64_t i = 0; i < RB; ++i) {
      if (i >= nr) break;
      const __m512 c = _mm512_set1_ps(corr[r0 + i]);
      for (int64_t j = 0; j < 2 * DW; ++j) o[i][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * D + 16 * j), c);
    }
    for (int64_t t = 0; t < n; t += 2) {
      if (next_k != nullptr && r0 == 0) {  // the next block's rows of this head, two tokens a step
        for (int64_t u = t; u < std::min(t + 2, next_n); ++u) {
          for (int64_t j = 0; j < D; j += 32) {
            _mm_prefetch(reinterpret_cast<const char*>(next_k + u * stride + j), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(next_v + u * stride + j), _MM_HINT_T0);
          }
        }
      }
      __m512i lo[DW], hi[DW];
      for (int64_t j = 0; j < DW; ++j) {
        const __m512i a = _mm512_loadu_si512(v + t * stride + 32 * j);
        // An odd last token pairs with zeros (the row past it may hold anything, NaN included).
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * stride + 32 * j) : _mm512_setzero_si512();
        lo[j] = _mm512_unpacklo_epi16(a, b);
        hi[j] = _mm512_unpackhi_epi16(a, b);
      }
      for (int64_t i = 0; i < RB; ++i) {
        if (i >= nr) break;
        const __m512i w_hi = _mm512_set1_epi32(static_cast<int>(pw[(r0 + i) * 16 + t / 2]));
        const __m512i w_lo = _mm512_set1_epi32(static_cast<int>(pw[(r0 + i) * 16 + 8 + t / 2]));
        for (int64_t j = 0; j < DW; ++j) {
          o[i][2 * j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(o[i][2 * j], as_bh(lo[j]), as_bh(w_hi)), as_bh(lo[j]),
                                         as_bh(w_lo));
          o[i][2 * j + 1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(o[i][2 * j + 1], as_bh(hi[j]), as_bh(w_hi)),
                                             as_bh(hi[j]), as_bh(w_lo));
        }
      }
    }
    for (int64_t i = 0; i < RB; ++i) {
      if (i >= nr) break;
      for (int64_t j = 0; j < 2 * DW; ++j) _mm512_storeu_ps(acc + (r0 + i) * D + 16 * j, o[i][j]);
    }
  }
}

// Tile scores from bf16 pairs: st[t][rows] = scale * sum_d k[t][d] q[rows][d] for NT tokens, with
// qt2 (D / 2, RV * 16) the rows' queries as bf16 pairs (elements 2i, 2i + 1 of a row in one 32-bit
// lane, rows in lanes) and k the block's bf16 rows in place, a pair of a row broadcast per step.
template <int64_t D, int64_t RV, int64_t NT>
inline void scores_pairs(const uint32_t* qt2, const c10::BFloat16* k, int64_t stride, float scale, float* st) {
  constexpr int64_t RP = RV * 16;
  static_assert(NT == 4 || NT == 8, "4 or 8 tokens");
  __m512 a0[RV], a1[RV], a2[RV], a3[RV], a4[RV], a5[RV], a6[RV], a7[RV];
  for (int64_t j = 0; j < RV; ++j) {
    a0[j] = a1[j] = a2[j] = a3[j] = _mm512_setzero_ps();
    if (NT == 8) a4[j] = a5[j] = a6[j] = a7[j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < D / 2; ++i) {
    __m512i qd[RV];
    for (int64_t j = 0; j < RV; ++j) qd[j] = _mm512_loadu_si512(qt2 + i * RP + 16 * j);
#define PS_TOKEN(T, A)                                                                       \
  {                                                                                          \
    int32_t pair;                                                                            \
    std::memcpy(&pair, k + (T) * stride + 2 * i, sizeof(pair));                              \
    const __m512i kd = _mm512_set1_epi32(pair);                                              \
    for (int64_t j = 0; j < RV; ++j) A[j] = _mm512_dpbf16_ps(A[j], as_bh(qd[j]), as_bh(kd)); \
  }
    PS_TOKEN(0, a0) PS_TOKEN(1, a1) PS_TOKEN(2, a2) PS_TOKEN(3, a3)
    if (NT == 8) { PS_TOKEN(4, a4) PS_TOKEN(5, a5) PS_TOKEN(6, a6) PS_TOKEN(7, a7) }
#undef PS_TOKEN
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < RV; ++j) {
    _mm512_storeu_ps(st + 0 * RP + 16 * j, _mm512_mul_ps(a0[j], sc));
    _mm512_storeu_ps(st + 1 * RP + 16 * j, _mm512_mul_ps(a1[j], sc));
    _mm512_storeu_ps(st + 2 * RP + 16 * j, _mm512_mul_ps(a2[j], sc));
    _mm512_storeu_ps(st + 3 * RP + 16 * j, _mm512_mul_ps(a3[j], sc));
    if (NT == 8) {
      _mm512_storeu_ps(st + 4 * RP + 16 * j, _mm512_mul_ps(a4[j], sc));
      _mm512_storeu_ps(st + 5 * RP + 16 * j, _mm512_mul_ps(a5[j], sc));
      _mm512_storeu_ps(st + 6 * RP + 16 * j, _mm512_mul_ps(a6[j], sc));
      _mm512_storeu_ps(st + 7 * RP + 16 * j, _mm512_mul_ps(a7[j], sc));
    }
  }
}

// A block's scores for a tile (n_all tokens, 8 or 4 at a time as tile_block does; rows past
// n_all in a group of 4 are computed and never used: the block holds them, whatever they are).
template <int64_t D, int64_t RV>
inline void tile_scores_pairs(const uint32_t* qt2, const c10::BFloat16* k, int64_t stride, int64_t n_all,
                              float scale, float* st) {
  constexpr int64_t RP = RV * 16;
  for (int64_t t0 = 0; t0 < n_all; t0 += 8) {
    if (n_all - t0 >= 8) {
      scores_pairs<D, RV, 8>(qt2, k + t0 * stride, stride, scale, st + t0 * RP);
    } else {
      scores_pairs<D, RV, 4>(qt2, k + t0 * stride, stride, scale, st + t0 * RP);
      if (n_all - t0 > 4) scores_pairs<D, RV, 4>(qt2, k + (t0 + 4) * stride, stride, scale, st + (t0 + 4) * RP);
    }
  }
}
#else
constexpr bool kPairs = false;
#endif

struct Item {
  int64_t seq;         // index into seq_ids
  int64_t kv_head;     // tile items: the KV head; decode items: -1 (all heads)
  int64_t first_q;     // tile items: first query position of the tile (0 for decode)
  int64_t num_q;       // query positions
  int64_t blk_begin;   // decode items: the slice of blocks [blk_begin, blk_end); tile items: all visible
  int64_t blk_end;
  int64_t part;        // decode items split in slices: the slice's index into the partials; -1: not split
  int64_t cost;
  int64_t g0 = 0;      // tile items: the query heads g0 .. g0 + gn - 1 of the KV head's group (gn = group
  int64_t gn = 0;      // unless a group alone has more than kTileRows heads)
};

struct Shapes {
  int64_t num_q_heads, num_kv_heads, group, block_size, num_blocks, max_blocks, token_stride;
  float scale;
};

#ifdef __AVX512BF16__
#include "prefill_tiles.h"
#endif
#ifdef PAGEDSERVE_AMX_TILES
#include "decode_tiles.h"  // (uses quant_linear.h's transpose16, first_lanes: cpu_ops.cpp includes it first)
#endif

template <int64_t D, int64_t RV, typename T>
void run_tile_item(const Item& it, const Shapes& sh, const T* q_ptr, T* o_ptr, const T* k_ptr,
                   const T* v_ptr, const int32_t* table, int64_t q_start, int64_t context, float* buf) {
  constexpr int64_t RP = RV * 16;
  const int64_t g = it.gn, num_rows = it.num_q * g, head0 = it.kv_head * sh.group + it.g0;
  float* qt = buf;                      // D x RP
  float* acc = qt + D * RP;             // RP x D
  float* st = acc + RP * D;             // 16 x RP
  float* m = st + kMaxBlockSize * RP;   // RP
  float* l = m + RP;
  float* corr = l + RP;
  float* kf = corr + RP;                // bfloat16 K/V: this head's rows of a block, widened (2 x 16 x D)
  float* vf = kf + kMaxBlockSize * D;
  // bf16 with AVX512-BF16: the scores from bf16 pairs, K in place (tile_scores_pairs); qt then holds
  // the queries as (D / 2, RP) pairs, not scaled. V is widened as for the float32 arithmetic below.
  constexpr bool pairs = kPairs && std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
  uint32_t* qt2 = reinterpret_cast<uint32_t*>(qt);
  std::fill(qt, qt + D * RP, 0.0f);
  for (int64_t r = 0; r < num_rows; ++r) {
    const T* src = q_ptr + ((q_start + it.first_q + r / g) * sh.num_q_heads + head0 + r % g) * D;
    if constexpr (pairs) {
      for (int64_t i = 0; i < D / 2; ++i) std::memcpy(qt2 + i * RP + r, src + 2 * i, sizeof(uint32_t));
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * RP + r] = static_cast<float>(src[d]) * sh.scale;
    }
  }
  std::fill(acc, acc + RP * D, 0.0f);
  std::fill(m, m + RP, -std::numeric_limits<float>::infinity());
  std::fill(l, l + RP, 0.0f);
  __m512i row_pos[RV];  // query position offset of each row in the tile: r / group (padded rows: see nothing)
  for (int64_t j = 0; j < RV; ++j) {
    alignas(64) int32_t pos[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = 16 * j + i;
      pos[i] = r < num_rows ? static_cast<int32_t>(r / g) : std::numeric_limits<int32_t>::min() / 2;
    }
    row_pos[j] = _mm512_load_si512(pos);
  }
  const int64_t last_visible = context + it.first_q + it.num_q - 1;
  for (int64_t blk = 0; blk * sh.block_size <= last_visible; ++blk) {
    const int64_t physical = table[blk];
    TORCH_CHECK(physical >= 0 && physical < sh.num_blocks, "block id out of range");
    const int64_t base = physical * sh.block_size * sh.token_stride + it.kv_head * D;
    const int64_t first_row_visible = context + it.first_q - blk * sh.block_size + 1;
    const int64_t n_all = std::min(sh.block_size, first_row_visible + it.num_q - 1);
    __m512i limit[RV];
    for (int64_t j = 0; j < RV; ++j)
      limit[j] = _mm512_add_epi32(row_pos[j], _mm512_set1_epi32(static_cast<int>(first_row_visible)));
    const float* k = nullptr;
    const float* v = nullptr;
    int64_t stride = sh.token_stride;
    if constexpr (std::is_same_v<T, float>) {
      k = k_ptr + base;
      v = v_ptr + base;
    } else {
#ifdef __AVX512BF16__
      if constexpr (pairs) {
        tile_scores_pairs<D, RV>(qt2, k_ptr + base, sh.token_stride, n_all, sh.scale, st);
      } else {
        widen_rows(k_ptr + base, sh.token_stride, n_all, D, kf);
        k = kf;
      }
#else
      widen_rows(k_ptr + base, sh.token_stride, n_all, D, kf);
      k = kf;
#endif
      widen_rows(v_ptr + base, sh.token_stride, n_all, D, vf);
      v = vf;
      stride = D;
    }
    if (first_row_visible >= n_all) {  // every row sees the whole block (all but the diagonal ones)
      tile_block<D, RV, false>(qt, limit, num_rows, k, v, stride, n_all, m, l, acc, st, corr);
    } else {
      tile_block<D, RV, true>(qt, limit, num_rows, k, v, stride, n_all, m, l, acc, st, corr);
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    T* dst = o_ptr + ((q_start + it.first_q + r / g) * sh.num_q_heads + head0 + r % g) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t d = 0; d < D; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv));
  }
}

// A decode item: all query heads of it.num_q (<= kDecodeMaxQ) consecutive query positions (one for a
// decode, a few for speculative verification), blocks [blk_begin, blk_end). Rows are ordered by KV
// head, then position, then head within the group. Unsplit items write the output; split ones
// (single positions only) write their unnormalised partial (acc, max, sum per head) for the merge.
template <int64_t D, typename T>
void run_decode_item(const Item& it, const Shapes& sh, const T* q_ptr, T* o_ptr, const T* k_ptr,
                     const T* v_ptr, const int32_t* table, int64_t q_row, int64_t seq_len, float* buf,
                     float* partials) {
  const int64_t hq = sh.num_q_heads, g = sh.group, nq = it.num_q, rows = nq * hq, head_rows = nq * g;
  float* q = buf;               // rows x D
  float* acc = q + rows * D;    // rows x D
  float* p = acc + rows * D;    // rows x 16
  float* l = p + rows * 16;     // rows x 16
  float* m = l + rows * 16;
  float* corr = m + rows;
  float* kf = corr + rows;  // bfloat16 K/V: the whole block, widened (2 x block_size x token_stride)
  float* vf = kf + sh.block_size * sh.token_stride;
  const auto token_row = [&](int64_t r) {  // row r -> (query position, query head) as an offset in q/out
    const int64_t h = r / head_rows, i = (r % head_rows) / g, gg = r % g;
    return ((q_row + i) * hq + h * g + gg) * D;
  };
  // bf16 with AVX512-BF16: pairs of bf16 in place (decode_block_pairs); q copied as bf16, unscaled.
  constexpr bool pairs = kPairs && std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q_ptr + token_row(r);
    if constexpr (pairs) {
      std::copy(src, src + D, reinterpret_cast<T*>(q) + r * D);
    } else {
      for (int64_t d = 0; d < D; ++d) q[r * D + d] = static_cast<float>(src[d]) * sh.scale;
    }
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows * 16, 0.0f);
  const int64_t context = seq_len - nq;
  const int64_t block_floats = sh.block_size * sh.token_stride;
  bool on_tiles = false;  // the item's blocks done on AMX tiles (decode_tiles.h) instead of the loop below
#ifdef PAGEDSERVE_AMX_TILES
  if constexpr (pairs) {
    if (nq == 1 && decode_tiles::takes(g, sh.block_size)) {
      decode_tiles::run_blocks<D>(reinterpret_cast<const T*>(q), k_ptr, v_ptr, table, it.blk_begin, it.blk_end,
                                  seq_len, sh, m, l, acc);
      on_tiles = true;
    }
  }
#endif
  const int64_t block_lines = (block_floats * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const auto far_block = [&](int64_t blk) {  // the pool offset of the item's block blk, or -1
    return blk < it.blk_end && table[blk] >= 0 && table[blk] < sh.num_blocks ? table[blk] * block_floats : -1;
  };
  for (int64_t blk = it.blk_begin; !on_tiles && blk < std::min(it.blk_end, it.blk_begin + kFarBlocks); ++blk) {
    if (far_block(blk) >= 0) prefetch_l2(k_ptr + far_block(blk), v_ptr + far_block(blk), 0, block_lines);
  }
  for (int64_t blk = on_tiles ? it.blk_end : it.blk_begin; blk < it.blk_end; ++blk) {
    const int64_t physical = table[blk];
    TORCH_CHECK(physical >= 0 && physical < sh.num_blocks, "block id out of range");
    const int64_t n = std::min(sh.block_size, seq_len - blk * sh.block_size);
    const int64_t base = physical * block_floats;
    // The next block's K/V rows are prefetched while this block computes (block ids are known).
    int64_t next_base = -1, next_n = 0;
    if (blk + 1 < it.blk_end && table[blk + 1] >= 0 && table[blk + 1] < sh.num_blocks) {
      next_base = table[blk + 1] * block_floats;
      next_n = std::min(sh.block_size, seq_len - (blk + 1) * sh.block_size);
    }
    const int64_t first_row_visible = context + 1 - blk * sh.block_size;  // tokens position 0 sees
    const int64_t far_base = far_block(blk + kFarBlocks);
#ifdef __AVX512BF16__
    if constexpr (pairs) {
      const T* kb = k_ptr + base;
      const T* vb = v_ptr + base;
      for (int64_t h = 0; h < sh.num_kv_heads; ++h) {
        if (far_base >= 0) {
          prefetch_l2(k_ptr + far_base, v_ptr + far_base, h * block_lines / sh.num_kv_heads,
                      (h + 1) * block_lines / sh.num_kv_heads);
        }
        const T* next_k = next_base < 0 ? nullptr : k_ptr + next_base + h * D;
        const T* next_v = next_base < 0 ? nullptr : v_ptr + next_base + h * D;
        const int64_t r0 = h * head_rows;
        const T* qh = reinterpret_cast<const T*>(q) + r0 * D;
        uint32_t* pw = reinterpret_cast<uint32_t*>(p);  // rows x 16 words, the size of p
        if (n == kMaxBlockSize && first_row_visible >= n) {
          decode_block_pairs<D, true>(qh, head_rows, kb + h * D, vb + h * D, sh.token_stride, n, first_row_visible, g,
                                      sh.scale, m + r0, l + r0 * 16, acc + r0 * D, pw + r0 * 16, corr + r0, next_k,
                                      next_v, next_n);
        } else {
          decode_block_pairs<D, false>(qh, head_rows, kb + h * D, vb + h * D, sh.token_stride, n, first_row_visible,
                                       g, sh.scale, m + r0, l + r0 * 16, acc + r0 * D, pw + r0 * 16, corr + r0, next_k,
                                       next_v, next_n);
        }
      }
      continue;
    }
#endif
    if (far_base >= 0) prefetch_l2(k_ptr + far_base, v_ptr + far_base, 0, block_lines);
    const float* k = nullptr;
    const float* v = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      k = k_ptr + base;
      v = v_ptr + base;
    } else {  // the block's n tokens, all heads: one contiguous run each of K and V
      widen_rows(k_ptr + base, sh.token_stride, n, sh.token_stride, kf, next_base < 0 ? nullptr : k_ptr + next_base);
      widen_rows(v_ptr + base, sh.token_stride, n, sh.token_stride, vf, next_base < 0 ? nullptr : v_ptr + next_base);
      k = kf;
      v = vf;
      next_base = -1;  // prefetched above
    }
    for (int64_t h = 0; h < sh.num_kv_heads; ++h) {
      const float* next_k = next_base < 0 ? nullptr : reinterpret_cast<const float*>(k_ptr + next_base + h * D);
      const float* next_v = next_base < 0 ? nullptr : reinterpret_cast<const float*>(v_ptr + next_base + h * D);
      const int64_t r0 = h * head_rows;
      if (n == kMaxBlockSize && first_row_visible >= n) {
        decode_block<D, true>(q + r0 * D, head_rows, k + h * D, v + h * D, sh.token_stride, n, first_row_visible, g,
                              m + r0, l + r0 * 16, acc + r0 * D, p + r0 * 16, corr + r0, next_k, next_v, next_n);
      } else {
        decode_block<D, false>(q + r0 * D, head_rows, k + h * D, v + h * D, sh.token_stride, n, first_row_visible, g,
                               m + r0, l + r0 * 16, acc + r0 * D, p + r0 * 16, corr + r0, next_k, next_v, next_n);
      }
    }
  }
#ifdef __AVX512BF16__
  if constexpr (pairs) unpermute_pairs<D>(acc, rows);
#endif
  for (int64_t r = 0; r < rows; ++r) corr[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(l + r * 16));  // row sums
  l = corr;
  if (it.part < 0) {
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = o_ptr + token_row(r);
      const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
      for (int64_t d = 0; d < D; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv));
    }
  } else {
    float* part = partials + it.part * hq * (D + 2);  // per head: acc (D), max, sum
    for (int64_t r = 0; r < hq; ++r) {
      std::copy(acc + r * D, acc + (r + 1) * D, part + r * (D + 2));
      part[r * (D + 2) + D] = m[r];
      part[r * (D + 2) + D + 1] = l[r];
    }
  }
}

template <int64_t D, typename T>
void paged_attention(T* o_ptr, const T* q_ptr, const T* k_ptr, const T* v_ptr, const int32_t* tables,
                     const int32_t* lens, const int32_t* cu, const int64_t* ids, int64_t num_seqs, const Shapes& sh) {
  const int64_t g = sh.group;
  const int64_t tile_q = std::max<int64_t>(1, kTileRows / g);
  // Prompts of at least kTilesMinQ new tokens on AMX tiles (prefill_tiles.h), bf16 only; the rest below.
  std::vector<char> on_tiles(num_seqs, 0);
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (prefill_tiles::available()) {
      std::vector<int64_t> prompts;
      for (int64_t i = 0; i < num_seqs; ++i) {
        if (cu[ids[i] + 1] - cu[ids[i]] >= prefill_tiles::kTilesMinQ) {
          prompts.push_back(i);
          on_tiles[i] = 1;
        }
      }
      if (!prompts.empty()) prefill_tiles::run<D>(prompts, o_ptr, q_ptr, k_ptr, v_ptr, tables, lens, cu, ids, sh);
    }
  }
#endif
  // Decode slices: enough items for every thread (four each), each at least 16 blocks long.
  int64_t decode_blocks = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t b = ids[i];
    if (cu[b + 1] - cu[b] == 1) decode_blocks += (lens[b] + sh.block_size - 1) / sh.block_size;
  }
  const int64_t threads = at::get_num_threads();
  const int64_t slice_blocks = std::max<int64_t>(16, (decode_blocks + 4 * threads - 1) / (4 * threads));
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (seq index, first partial) of each split decode
  int64_t num_parts = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    if (on_tiles[i]) continue;
    const int64_t b = ids[i], q_len = cu[b + 1] - cu[b], seq_len = lens[b];
    const int64_t blocks = (seq_len + sh.block_size - 1) / sh.block_size;
    if (q_len <= kDecodeMaxQ) {
      const int64_t slices = q_len == 1 ? (blocks + slice_blocks - 1) / slice_blocks : 1;
      if (slices > 1) merges.emplace_back(i, num_parts);
      for (int64_t s = 0; s < slices; ++s) {
        const int64_t begin = s * blocks / slices, end = (s + 1) * blocks / slices;
        items.push_back({i, -1, 0, q_len, begin, end, slices > 1 ? num_parts++ : -1,
                         (end - begin) * sh.num_q_heads * q_len});
      }
      continue;
    }
    for (int64_t h = 0; h < sh.num_kv_heads; ++h) {
      for (int64_t first = 0; first < q_len; first += tile_q) {
        const int64_t num_q = std::min(tile_q, q_len - first);
        const int64_t last_blk = (seq_len - q_len + first + num_q - 1) / sh.block_size + 1;
        for (int64_t g0 = 0; g0 < g; g0 += kTileRows) {
          const int64_t gn = std::min(kTileRows, g - g0);
          items.push_back({i, h, first, num_q, 0, last_blk, -1, last_blk * std::max<int64_t>(16, num_q * gn), g0, gn});
        }
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<float> partials(num_parts * sh.num_q_heads * (D + 2));
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t widened = std::is_same_v<T, float> ? 0 : 2 * kMaxBlockSize * sh.token_stride;  // >= 2 x 16 x D
  const int64_t buf_floats = std::max(D * 64 + 64 * D + 16 * 64 + 3 * 64,
                                      kDecodeMaxQ * sh.num_q_heads * (2 * D + 32 + 2)) + widened;
  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    std::vector<float> buf(buf_floats);
    for (int64_t idx = next.fetch_add(1); idx < num_items; idx = next.fetch_add(1)) {
      const Item& it = items[idx];
      const int64_t b = ids[it.seq], q_len = cu[b + 1] - cu[b];
      const int32_t* table = tables + b * sh.max_blocks;
      if (it.kv_head < 0) {
        run_decode_item<D, T>(it, sh, q_ptr, o_ptr, k_ptr, v_ptr, table, cu[b], lens[b], buf.data(), partials.data());
        continue;
      }
      const int64_t rows = it.num_q * it.gn, context = lens[b] - q_len;
      if (rows <= 16) {
        run_tile_item<D, 1, T>(it, sh, q_ptr, o_ptr, k_ptr, v_ptr, table, cu[b], context, buf.data());
      } else if (rows <= 32) {
        run_tile_item<D, 2, T>(it, sh, q_ptr, o_ptr, k_ptr, v_ptr, table, cu[b], context, buf.data());
      } else {
        run_tile_item<D, 3, T>(it, sh, q_ptr, o_ptr, k_ptr, v_ptr, table, cu[b], context, buf.data());
      }
    }
  });
  for (const auto& [i, first] : merges) {  // split decodes: rescale each slice to the common max, add
    const int64_t b = ids[i], hq = sh.num_q_heads;
    const int64_t blocks = (lens[b] + sh.block_size - 1) / sh.block_size;
    const int64_t slices = (blocks + slice_blocks - 1) / slice_blocks;
    T* dst = o_ptr + cu[b] * hq * D;
    for (int64_t r = 0; r < hq; ++r) {
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < slices; ++s) max = std::max(max, partials[((first + s) * hq + r) * (D + 2) + D]);
      float out[D] = {}, sum = 0.0f;
      for (int64_t s = 0; s < slices; ++s) {
        const float* part = partials.data() + ((first + s) * hq + r) * (D + 2);
        const float w = _mm512_cvtss_f32(exp512(_mm512_set1_ps(part[D] - max)));
        sum += part[D + 1] * w;
        for (int64_t d = 0; d < D; ++d) out[d] += part[d] * w;
      }
      for (int64_t d = 0; d < D; ++d) dst[r * D + d] = static_cast<T>(out[d] / sum);
    }
  }
}

}  // namespace avx512_attention
}  // namespace
