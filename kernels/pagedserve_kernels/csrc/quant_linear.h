// Weight-only quantized linears, included by cpu_ops.cpp: y (M, N) = x (M, K) @ W^T + bias with W kept
// in memory as 8-, 6- or 4-bit integers and computed on as they are, never widened for the whole model.
//
// The weight: per output column n and group of `group` consecutive inputs g, W[n, k] = q[n, k] *
// scale[g, n] + min[g, n], q a signed 8-bit integer (bits 8), a signed 6-bit one (bits 6, -32..31;
// GGUF's Q6_K and Q5_* blocks) or an unsigned 4-bit one (bits 4; GGUF's Q4_0/Q4_1/Q4_K blocks), scale
// and min float16 (no min: zero). Packed in column blocks of kBlockN like the bf16 tiles
// (brgemm_linear.h), pairs of K interleaved, so that a block de-quantizes straight into the layout the
// tiles and the dot products read:
//   bits 8: q (N / kBlockN, K / 2, kBlockN, 2) int8;
//   bits 4: (N / kBlockN, K / 2, kBlockN / 16, 16) uint8: for each 16 columns of a pair row, the 32
//           values (column-major pairs) v[0..31] as byte i = v[i] | v[i + 16] << 4;
//   bits 6: (N / kBlockN, K / 2, 96) uint8: per pair row, u = q + 32 (0..63): its low 4 bits as bits 4
//           packs them (64 bytes), then their high 2 bits (32 bytes): byte m holds h[m] | h[m + 32] << 4,
//           h[j] = (high bits of nibble byte j's low value) | (those of its high value) << 2;
//   scales, mins: (N / kBlockN, K / group, kBlockN) float16; or compact (6 and 4 bits, a K-quant's:
//           each scale or min a whole multiple of one float16 per kSuperK inputs, its d or -dmin):
//           (N / kBlockN, K / kSuperK, super_bytes()) bytes, per superblock the kBlockN columns' float16
//           factors, then each of its groups' kBlockN int8 multiples (4.625 bits a Q4_K weight, against
//           5 with float16 scales and mins; the file: 4.5), both in the column order the 4- and 6-bit
//           paths' registers hold (`x_position`), so that those read them without a permute.
//
// Each thread takes a contiguous run of column blocks (one stream through its share of the weight, as
// in brgemm_linear.h) and, per block, de-quantizes a slice of K into bf16 in L1 (`dequantize`: 16
// values a multiply-add, rounded to bf16 once) and multiplies every row of x by it: on AMX tiles
// where `brgemm_linear::available()` (up to kTileRows rows our own tile loop, `tile_blocks`; more,
// ATen's bf16 brgemm), else with AVX512-BF16 dot products (`dot_rows`). A prompt's rows (kOnednnRows
// and more, bf16 out) go to oneDNN's matmul instead, a few blocks at a time widened into plain bf16
// rows (`linear_onednn`). Without AMX tiles, where the CPU has AVX512-VNNI, the activations are
// quantized to int8 and the integers multiplied as they are: 3 to kVnniRows rows (a decode batch) a
// group at a time (`vnni_block`), more (a prompt) in tiles of 3 rows over a block's whole K
// (`vnni_tiles`), instead of oneDNN.
// The products accumulate in float32 over the whole of K; outputs float32 or rounded to the
// activations' bf16 once. float32 activations (a float32 model) multiply the integers as they are too,
// each row split in two (`linear_float`), where the build has AVX512-BF16 and AVX512-VNNI. A build
// without them takes `dequantize_scalar` (the same values) and at::linear on the widened weight:
// correct, not fast.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "brgemm_linear.h"
#include "claims.h"

namespace {
namespace quant_linear {

constexpr int64_t kBlockN = 64;    // output columns a block holds (four 16-column groups)
constexpr int64_t kSliceK = 256;   // inputs de-quantized at a time when all rows fit one pass (32 KiB: L1)
constexpr int64_t kBlockM = 32;    // rows of x one brgemm call takes
// Up to these rows the weight is de-quantized in registers and used at once (`fused`): per-group scales
// and mins hold registers, so fewer rows share one pass there.
constexpr int64_t kFusedRows = 4, kFusedRowsGrouped = 2;
constexpr int64_t kPrefetch = 2048;  // bytes ahead of the few-row path's read position (16 lines)
// From these rows on (a prompt chunk) the weight goes to oneDNN's matmul a few blocks at a time, widened
// to plain bf16 rows (`linear_onednn`): its blocking for prompt-sized M does about twice the FLOPS
// of our brgemm passes over a block, which pays for the widening from ~200 rows on (docs/benchmarks.md,
// "Quantized prompts on oneDNN"). Not where int8 activations run (`vnni_tile_rows`: past kVnniRows).
constexpr int64_t kOnednnRows = 192;
constexpr int64_t kChunkBlocks = 4;  // column blocks a oneDNN call takes (256 columns)

constexpr int64_t kSuperK = 256;  // inputs a compact scale factor covers (a K-quant's block)

struct Weight {
  const uint8_t* q;
  const void* scales;
  const void* mins;  // nullptr: no min (symmetric)
  int64_t bits, group, K, blocks;
  bool compact;  // scales and mins as int8 multiples of a float16 per kSuperK inputs (group: a power of 2)
  // Derived once (`make`): the hot loops ask for a group's scales without dividing.
  int64_t num_groups = 0, per_super_log = 0;  // K / group; log2(kSuperK / group) where compact

  static Weight make(const uint8_t* q, const void* scales, const void* mins, int64_t bits, int64_t group, int64_t K,
                     int64_t blocks, bool compact) {
    Weight w{q, scales, mins, bits, group, K, blocks, compact};
    w.num_groups = K / group;
    while (compact && (group << w.per_super_log) < kSuperK) ++w.per_super_log;
    return w;
  }

  int64_t block_bytes() const { return K * kBlockN * bits / 8; }
  int64_t groups() const { return num_groups; }
  int64_t super_bytes() const { return (2 + (int64_t{1} << per_super_log)) * kBlockN; }
  // Where group g of block b keeps its columns' values of `at` (scales or mins): float16 ones, or for a
  // compact weight its superblock's factors and the group's multiples.
  const c10::Half* halves(const void* at, int64_t b, int64_t g) const {
    return static_cast<const c10::Half*>(at) + (b * num_groups + g) * kBlockN;
  }
  const uint8_t* super(const void* at, int64_t b, int64_t g) const {
    return static_cast<const uint8_t*>(at) + ((b * num_groups + g) >> per_super_log) * super_bytes();
  }
  const int8_t* multiples(const void* at, int64_t b, int64_t g) const {
    return reinterpret_cast<const int8_t*>(super(at, b, g) + (2 + (g & ((int64_t{1} << per_super_log) - 1))) * kBlockN);
  }
  // Column n's scale (or min) of group g of block b.
  float group_value(const void* at, int64_t b, int64_t g, int64_t n) const {
    if (!compact) return static_cast<float>(halves(at, b, g)[n]);
    const int64_t x = x_position(n);
    const float factor = static_cast<float>(reinterpret_cast<const c10::Half*>(super(at, b, g))[x]);
    return static_cast<float>(multiples(at, b, g)[x]) * factor;  // exact: 8 bits times 11
  }
  // Where column n is in the 4- and 6-bit paths' registers (`fused_nibbles`, `vnni_columns<4>`): lane
  // l of register X holds column 16 (l / 4) + 4 X + l % 4, at 16 X + l.
  static int64_t x_position(int64_t n) { return 16 * (n % 16 / 4) + 4 * (n / 16) + n % 4; }
};

// Whether the few-row paths scale each group of a column (4 and 6 bits always), not only its sum.
inline bool by_group(const Weight& w) { return w.bits != 8 || w.group != w.K || w.mins != nullptr; }

// Up to how many rows `linear` de-quantizes the weight in registers (`fused`).
inline int64_t fused_rows(const Weight& w) { return by_group(w) ? kFusedRowsGrouped : kFusedRows; }

// The float value of W[n, k] for column n of block b (the reference every path agrees with).
inline float value(const Weight& w, int64_t b, int64_t k, int64_t n) {
  const uint8_t* q = w.q + b * w.block_bytes();
  const int64_t pair = k / 2, lane = 2 * (n % 16) + k % 2;  // lane: which of the 32 values of its 16 columns
  float v;
  if (w.bits == 8) {
    v = static_cast<float>(reinterpret_cast<const int8_t*>(q)[pair * 2 * kBlockN + 2 * n + k % 2]);
  } else if (w.bits == 4) {
    const uint8_t byte = q[pair * kBlockN + (n / 16) * 16 + lane % 16];
    v = static_cast<float>(lane < 16 ? byte & 15 : byte >> 4);
  } else {
    const uint8_t* row = q + pair * kBlockN * 6 / 4;
    const int64_t j = (n / 16) * 16 + lane % 16;  // its nibble byte
    const int high = (row[kBlockN + j % 32] >> (j < 32 ? 0 : 4)) >> (lane < 16 ? 0 : 2) & 3;
    const int low = lane < 16 ? row[j] & 15 : row[j] >> 4;
    v = static_cast<float>((low | high << 4) - 32);
  }
  const int64_t g = k / w.group;
  return v * w.group_value(w.scales, b, g, n) + (w.mins ? w.group_value(w.mins, b, g, n) : 0.0f);
}

// The whole weight widened to (N, K) float32 (the fallback's operand; tests' reference).
inline at::Tensor dequantize_scalar(const Weight& w) {
  at::Tensor out = at::empty({w.blocks * kBlockN, w.K}, at::kFloat);
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, w.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t n = 0; n < kBlockN; ++n)
        for (int64_t k = 0; k < w.K; ++k) dst[(b * kBlockN + n) * w.K + k] = value(w, b, k, n);
  });
  return out;
}

#ifdef __AVX512BF16__

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Columns [16c, 16c + 16) of group g of block b's float16 scales (or mins: `at`) as float32.
inline __m512 group16(const Weight& w, const void* at, int64_t b, int64_t g, int c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.halves(at, b, g) + 16 * c)));
}

// Four registers of 64 columns from the natural order (register c, lane j: column 16c + j) to the 4-
// and 6-bit paths' (`Weight::x_position`: register X, lane l: column 16 (l / 4) + 4 X + l % 4), and,
// the same exchange, back.
inline void swap_order(const __m512 in[4], __m512 out[4]) {
  for (int X = 0; X < 4; ++X) {  // lanes 4c..4c+3 of out[X]: lanes 4X..4X+3 of in[c]
    const int o = 4 * X;
    const __m512i lo_idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 19 + o, 18 + o, 17 + o, 16 + o, 3 + o, 2 + o, 1 + o, o);
    const __m512i hi_idx = _mm512_set_epi32(19 + o, 18 + o, 17 + o, 16 + o, 3 + o, 2 + o, 1 + o, o, 0, 0, 0, 0, 0, 0, 0, 0);
    out[X] = _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(in[0], lo_idx, in[1]),
                                  _mm512_permutex2var_ps(in[2], hi_idx, in[3]));
  }
}

// Group g of block b's 64 scales (or mins: `at`) as four registers in the 4- and 6-bit paths' column
// order (`Weight::x_position`). A compact weight's are stored in that order: the group's multiples
// widened and times its superblock's factors, no permute; float16 ones are permuted from the natural
// order.
// Inlined by force: a call per group passes the registers through memory (GCC left it out of line in
// the 6-bit one-row loop, 25% slower).
__attribute__((always_inline)) inline void group_x(const Weight& w, const void* at, int64_t b, int64_t g, __m512 out[4]) {
  if (w.compact) {
    const uint8_t* factors = w.super(at, b, g);
    const int8_t* multiples = w.multiples(at, b, g);
    for (int X = 0; X < 4; ++X) {
      const __m512 factor = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(factors + 32 * X)));
      const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(multiples + 16 * X));
      out[X] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(m)), factor);
    }
    return;
  }
  __m512 v[4];
  for (int c = 0; c < 4; ++c) v[c] = group16(w, at, b, g, c);
  swap_order(v, out);
}

// Group g of block b's 64 scales (or mins) in the natural order (register c: columns 16c..16c + 15).
__attribute__((always_inline)) inline void group_natural(const Weight& w, const void* at, int64_t b, int64_t g,
                                                         __m512 out[4]) {
  if (!w.compact) {
    for (int c = 0; c < 4; ++c) out[c] = group16(w, at, b, g, c);
    return;
  }
  __m512 x[4];
  group_x(w, at, b, g, x);
  swap_order(x, out);
}

// A pair row of a 6-bit block (96 bytes at `row`) as two registers of bytes u = q + 32 (0..63): byte j of
// `lo` the value whose low 4 bits are nibble byte j's low nibble, of `hi` its high nibble's (the order
// the 4-bit paths read their nibbles in).
inline void six_bit_pair(const uint8_t* row, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i bytes = _mm512_loadu_si512(row);
  const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kBlockN));
  const __m512i high =  // byte j: h[j], 4 bits
      _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(plane), _mm256_srli_epi16(plane, 4), 1), nibble);
  lo = _mm512_or_si512(_mm512_and_si512(bytes, nibble), _mm512_and_si512(_mm512_slli_epi16(high, 4), top));
  hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble),
                       _mm512_and_si512(_mm512_slli_epi16(high, 2), top));
}

// Inputs [k0, k0 + kc) of block b into buf (kc / 2, kBlockN, 2) bf16, the VNNI layout; k0 and kc even.
// Within 16 columns the 32 values of a pair row are v[0..15] (columns 0-7) and v[16..31] (columns
// 8-15), so each half takes its columns' scales spread over lane pairs.
template <int BITS>
inline void dequantize_bits(const Weight& w, int64_t b, int64_t k0, int64_t kc, c10::BFloat16* buf) {
  const __m512i spread_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i spread_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  const __m512 nibble_values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const uint8_t* q = w.q + b * w.block_bytes();
  int64_t k = k0;
  while (k < k0 + kc) {
    const int64_t g = k / w.group, stop = std::min(k0 + kc, (g + 1) * w.group);
    __m512 s_lo[4], s_hi[4], m_lo[4], m_hi[4], S[4], Mn[4];
    group_natural(w, w.scales, b, g, S);
    if (w.mins) {
      group_natural(w, w.mins, b, g, Mn);
    } else {
      for (int c = 0; c < 4; ++c) Mn[c] = _mm512_setzero_ps();
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 s = S[c], m = Mn[c];
      s_lo[c] = _mm512_permutexvar_ps(spread_lo, s), s_hi[c] = _mm512_permutexvar_ps(spread_hi, s);
      m_lo[c] = _mm512_permutexvar_ps(spread_lo, m), m_hi[c] = _mm512_permutexvar_ps(spread_hi, m);
    }
    for (; k < stop; k += 2) {
      const int64_t pair = k / 2;
      c10::BFloat16* out = buf + (k - k0) * kBlockN;  // (pair - k0 / 2) * 2 * kBlockN
      const uint8_t* row = q + pair * kBlockN * BITS / 4;
      for (int64_t line = 0; line < kBlockN * BITS / 4; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + line) + kPrefetch, _MM_HINT_T0);
      alignas(64) uint8_t six[2][64];  // bits 6: the pair row's values u, low nibbles' then high ones'
      if constexpr (BITS == 6) {
        __m512i lo, hi;
        six_bit_pair(row, lo, hi);
        _mm512_store_si512(six[0], lo);
        _mm512_store_si512(six[1], hi);
      }
      for (int c = 0; c < 4; ++c) {
        __m512 lo, hi;
        if constexpr (BITS == 6) {  // q = u - 32 in integers, as `value` takes it
          const __m512i offset = _mm512_set1_epi32(32);
          auto values = [&](const uint8_t* at) {
            return _mm512_cvtepi32_ps(_mm512_sub_epi32(
                _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(at))), offset));
          };
          lo = values(six[0] + 16 * c);
          hi = values(six[1] + 16 * c);
        } else if constexpr (BITS == 8) {
          const int8_t* src = reinterpret_cast<const int8_t*>(q) + pair * 2 * kBlockN + 32 * c;
          lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
          hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
        } else {
          // Each nibble's float by a 16-entry lookup (vpermps reads an index's low 4 bits only).
          const __m512i bytes = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + pair * kBlockN + 16 * c)));
          lo = _mm512_permutexvar_ps(bytes, nibble_values);
          hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), nibble_values);
        }
        lo = _mm512_fmadd_ps(lo, s_lo[c], m_lo[c]);
        hi = _mm512_fmadd_ps(hi, s_hi[c], m_hi[c]);
        _mm512_storeu_si512(out + 32 * c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      }
    }
  }
}

inline void dequantize(const Weight& w, int64_t b, int64_t k0, int64_t kc, c10::BFloat16* buf) {
  if (w.bits == 8) {
    dequantize_bits<8>(w, b, k0, kc, buf);
  } else if (w.bits == 6) {
    dequantize_bits<6>(w, b, k0, kc, buf);
  } else {
    dequantize_bits<4>(w, b, k0, kc, buf);
  }
}

// r[i] holds 16 dwords of row i; afterwards r[j] holds dword j of every row (a 16 x 16 transpose).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], 128-bit lane L: element 4L + e of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
    t[e] = _mm512_shuffle_i32x4(a, c, 0x88), t[8 + e] = _mm512_shuffle_i32x4(a, c, 0xdd);
    t[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88), t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Block b's kBlockN columns as plain bf16 rows: dst (kBlockN, K), row stride K; K a multiple of 32. Each
// 32 inputs are de-quantized into tmp (32 * kBlockN) in the VNNI layout (`dequantize`), where a pair row's
// 16 dwords are 16 columns' pairs, and transposed 16 x 16 into the columns' rows.
inline void dequantize_plain(const Weight& w, int64_t b, c10::BFloat16* dst, c10::BFloat16* tmp) {
  for (int64_t k0 = 0; k0 < w.K; k0 += 32) {
    dequantize(w, b, k0, 32, tmp);
    for (int c = 0; c < kBlockN / 16; ++c) {
      __m512i r[16];
      for (int p = 0; p < 16; ++p) r[p] = _mm512_loadu_si512(tmp + p * 2 * kBlockN + 32 * c);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (16 * c + j) * w.K + k0, r[j]);
    }
  }
}

// c (MR, kBlockN) float32 = rows [0, MR) of x (row stride ldx) times block b of an 8-bit weight, its
// integers widened to bf16 in registers (exactly: every int8 is a bf16 value) and multiplied at once
// (no buffer: the few-row path, where the weight is read once and each value used MR times). The
// products accumulate per group as integers times x (`xsum` (MR, K / group): each row's sum over each
// group, for the mins); each group's sum is then scaled and its min added, one multiply-add per group.
// GROUPED false: one symmetric scale per column (`group` == K, no mins), applied to the whole sum.
template <bool GROUPED, int MR>
inline void fused_rows(const Weight& w, int64_t b, const c10::BFloat16* x, int64_t ldx, const float* xsum, float* c) {
  const int8_t* q = reinterpret_cast<const int8_t*>(w.q + b * w.block_bytes());
  const c10::Half* scales = w.halves(w.scales, b, 0);  // 8 bits: never compact
  const c10::Half* mins = w.mins ? w.halves(w.mins, b, 0) : nullptr;
  auto halves = [](const c10::Half* at) {  // 16 float16 -> float32
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  };
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t groups = GROUPED ? w.groups() : 1, pairs_per_group = w.K / groups / 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[GROUPED ? MR : 1][4];
    if constexpr (GROUPED) {
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) part[i][j] = _mm512_setzero_ps();
    }
    for (int64_t pair = g * pairs_per_group; pair < (g + 1) * pairs_per_group; ++pair) {
      __m512i xv[MR];
      for (int i = 0; i < MR; ++i) {
        int32_t pair_bits;
        std::memcpy(&pair_bits, x + i * ldx + 2 * pair, sizeof(pair_bits));
        xv[i] = _mm512_set1_epi32(pair_bits);
      }
      for (int j = 0; j < 4; ++j) {
        const int8_t* src = q + pair * 2 * kBlockN + 32 * j;
        if (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetch, _MM_HINT_T0);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
        const __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);
        for (int i = 0; i < MR; ++i) {
          if constexpr (GROUPED) {
            part[i][j] = _mm512_dpbf16_ps(part[i][j], as_bh(xv[i]), wv);
          } else {
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(xv[i]), wv);
          }
        }
      }
    }
    if constexpr (GROUPED) {
      for (int j = 0; j < 4; ++j) {
        const __m512 scale = halves(scales + g * kBlockN + 16 * j);
        const __m512 minimum = mins ? halves(mins + g * kBlockN + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < MR; ++i) {
          acc[i][j] = _mm512_fmadd_ps(part[i][j], scale, acc[i][j]);
          if (mins) acc[i][j] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsum[i * groups + g]), acc[i][j]);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 scale = GROUPED ? _mm512_set1_ps(1.0f) : halves(scales + 16 * j);
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(c + i * kBlockN + 16 * j, _mm512_mul_ps(acc[i][j], scale));
  }
}

// The few-row path at 4 and 6 bits (rows [0, MR) of x; `xsum` (MR, K / group): each row's sum over each group,
// for the mins). Nibbles become bf16 by table lookup, exactly (0..15 are bf16 values): per pair row the
// block's 64 bytes split into low and high nibbles, two `vpshufb` per half give each value's bf16 low
// and high byte, and byte interleaves make the words: 4 registers of 16 columns x 2 inputs, columns in
// the order the interleave leaves them (register X, 32-bit lane 4c + j: column 16c + 4X + j). The
// products accumulate per group as integers times x; each group's sum is then scaled and its min
// added (scale * sum(x q) + min * sum(x)): one multiply-add per group instead of one per value.
// At 6 bits each value u = q + 32 becomes the bf16 word 0x43 << 8 | u, exactly 128 + u (an 8-bit
// exponent for 128, u in the mantissa's 7 bits): no table, and the group's sum takes the 160 back as
// -160 * scale * sum(x), folded into its min (the float32 sums carry the 160 and lose ~3 of their 24
// bits to it: within the tests' 1e-5).
template <int BITS, int MR>
inline void fused_nibbles(const Weight& w, int64_t b, const c10::BFloat16* x, int64_t ldx, const float* xsum,
                          float* c) {
  alignas(64) static const uint8_t kLow[64] = {
#define PAGEDSERVE_BF16_LOW 0x00, 0x80, 0x00, 0x40, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70
      PAGEDSERVE_BF16_LOW, PAGEDSERVE_BF16_LOW, PAGEDSERVE_BF16_LOW, PAGEDSERVE_BF16_LOW};
  alignas(64) static const uint8_t kHigh[64] = {
#define PAGEDSERVE_BF16_HIGH 0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41
      PAGEDSERVE_BF16_HIGH, PAGEDSERVE_BF16_HIGH, PAGEDSERVE_BF16_HIGH, PAGEDSERVE_BF16_HIGH};
#undef PAGEDSERVE_BF16_LOW
#undef PAGEDSERVE_BF16_HIGH
  const __m512i lut_low = _mm512_load_si512(kLow), lut_high = _mm512_load_si512(kHigh);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* q = w.q + b * w.block_bytes();
  const int64_t groups = w.groups(), pairs_per_group = w.group / 2;
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int X = 0; X < 4; ++X) acc[i][X] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // Scales (and mins) of the 64 columns in the registers' column order (`Weight::x_position`).
    __m512 sX[4], mX[4];
    group_x(w, w.scales, b, g, sX);
    if (w.mins) {
      group_x(w, w.mins, b, g, mX);
    } else {
      for (int X = 0; X < 4; ++X) mX[X] = _mm512_setzero_ps();
    }
    if constexpr (BITS == 6) {
      for (int X = 0; X < 4; ++X) mX[X] = _mm512_fnmadd_ps(_mm512_set1_ps(160.0f), sX[X], mX[X]);
    }
    __m512 part[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int X = 0; X < 4; ++X) part[i][X] = _mm512_setzero_ps();
    for (int64_t pair = g * pairs_per_group; pair < (g + 1) * pairs_per_group; ++pair) {
      const uint8_t* row = q + pair * kBlockN * BITS / 4;
      __m512i W[4];
      if constexpr (BITS == 4) {
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512(row);
        const __m512i lo = _mm512_and_si512(bytes, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        const __m512i lo_l = _mm512_shuffle_epi8(lut_low, lo), lo_h = _mm512_shuffle_epi8(lut_high, lo);
        const __m512i hi_l = _mm512_shuffle_epi8(lut_low, hi), hi_h = _mm512_shuffle_epi8(lut_high, hi);
        W[0] = _mm512_unpacklo_epi8(lo_l, lo_h), W[1] = _mm512_unpackhi_epi8(lo_l, lo_h);
        W[2] = _mm512_unpacklo_epi8(hi_l, hi_h), W[3] = _mm512_unpackhi_epi8(hi_l, hi_h);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch + 64, _MM_HINT_T0);
        const __m512i exponent = _mm512_set1_epi8(0x43);
        __m512i lo, hi;
        six_bit_pair(row, lo, hi);
        W[0] = _mm512_unpacklo_epi8(lo, exponent), W[1] = _mm512_unpackhi_epi8(lo, exponent);
        W[2] = _mm512_unpacklo_epi8(hi, exponent), W[3] = _mm512_unpackhi_epi8(hi, exponent);
      }
      for (int i = 0; i < MR; ++i) {
        int32_t pair_bits;
        std::memcpy(&pair_bits, x + i * ldx + 2 * pair, sizeof(pair_bits));
        const __m512i xv = _mm512_set1_epi32(pair_bits);
        for (int X = 0; X < 4; ++X) part[i][X] = _mm512_dpbf16_ps(part[i][X], as_bh(xv), as_bh(W[X]));
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 sum_x = _mm512_set1_ps(xsum[i * groups + g]);
      for (int X = 0; X < 4; ++X) {
        acc[i][X] = _mm512_fmadd_ps(part[i][X], sX[X], acc[i][X]);
        acc[i][X] = _mm512_fmadd_ps(mX[X], sum_x, acc[i][X]);
      }
    }
  }
  alignas(64) float lanes[16];
  for (int i = 0; i < MR; ++i)
    for (int X = 0; X < 4; ++X) {
      _mm512_store_ps(lanes, acc[i][X]);
      for (int l = 0; l < 16; ++l) c[i * kBlockN + 16 * (l / 4) + 4 * X + l % 4] = lanes[l];
    }
}

// 16 bf16 at p as float32 (exactly: a bf16 is a float32's high half).
__attribute__((always_inline)) inline __m512 widen16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Each row's sum over each group of `group` inputs, sums (M, K / group) float32 from x (M, K) bf16: what
// the grouped few-row paths multiply each group's min by. 16 inputs a step where a group holds whole
// steps (every format we hold), else one at a time.
inline void group_sums(const c10::BFloat16* x, int64_t M, int64_t K, int64_t group, float* sums) {
  const int64_t groups = K / group;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const c10::BFloat16* src = x + i * K + g * group;
      if (group % 16 == 0) {
        __m512 total = _mm512_setzero_ps();
        for (int64_t k = 0; k < group; k += 16) total = _mm512_add_ps(total, widen16(src + k));
        sums[i * groups + g] = _mm512_reduce_add_ps(total);
      } else {
        float total = 0.0f;
        for (int64_t k = 0; k < group; ++k) total += static_cast<float>(src[k]);
        sums[i * groups + g] = total;
      }
    }
  }
}

// The few-row path for rows [0, rows) of x: passes of the most rows its registers hold.
template <int BITS, bool GROUPED>
inline void fused(const Weight& w, int64_t b, const c10::BFloat16* x, int64_t ldx, int64_t rows, const float* xsum,
                  float* c) {
  const int64_t groups = w.groups();
  if constexpr (BITS != 8) {
    int64_t i = 0;
    for (; i + 2 <= rows; i += 2) fused_nibbles<BITS, 2>(w, b, x + i * ldx, ldx, xsum + i * groups, c + i * kBlockN);
    if (i < rows) fused_nibbles<BITS, 1>(w, b, x + i * ldx, ldx, xsum + i * groups, c + i * kBlockN);
    return;
  }
  constexpr int kRows = GROUPED ? 2 : 4;
  auto sums = [&](int64_t i) { return GROUPED ? xsum + i * groups : nullptr; };
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) fused_rows<GROUPED, kRows>(w, b, x + i * ldx, ldx, sums(i), c + i * kBlockN);
  switch (rows - i) {
    case 3: fused_rows<GROUPED, 3>(w, b, x + i * ldx, ldx, sums(i), c + i * kBlockN); break;
    case 2: fused_rows<GROUPED, 2>(w, b, x + i * ldx, ldx, sums(i), c + i * kBlockN); break;
    case 1: fused_rows<GROUPED, 1>(w, b, x + i * ldx, ldx, sums(i), c + i * kBlockN); break;
    default: break;
  }
}

// c (MR, kBlockN) float32 (+)= rows [0, MR) of x (row stride ldx, from input k0) times buf's kc inputs,
// with one vdpbf16ps per pair of inputs and 16 columns.
template <int MR>
inline void dot_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* buf, int64_t kc, float* c, bool add) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = add ? _mm512_loadu_ps(c + i * kBlockN + 16 * j) : _mm512_setzero_ps();
  for (int64_t p = 0; p < kc / 2; ++p) {
    const c10::BFloat16* row = buf + p * 2 * kBlockN;
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(row + 32 * j);
    for (int i = 0; i < MR; ++i) {
      int32_t pair_bits;
      std::memcpy(&pair_bits, x + i * ldx + 2 * p, sizeof(pair_bits));
      const __m512i xv = _mm512_set1_epi32(pair_bits);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(xv), as_bh(wv[j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(c + i * kBlockN + 16 * j, acc[i][j]);
}

// c (rows, kBlockN) (+)= x rows (stride ldx) times buf (kc inputs): AMX tiles or dot products.
inline void multiply(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* buf, int64_t kc, int64_t rows,
                     float* c, bool add, bool tiles) {
  if (tiles) {
    at::native::cpublas::brgemm(rows, kBlockN, kc, ldx, kBlockN, kBlockN, add, x, buf, c, true);
    return;
  }
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) dot_rows<4>(x + i * ldx, ldx, buf, kc, c + i * kBlockN, add);
  switch (rows - i) {
    case 3: dot_rows<3>(x + i * ldx, ldx, buf, kc, c + i * kBlockN, add); break;
    case 2: dot_rows<2>(x + i * ldx, ldx, buf, kc, c + i * kBlockN, add); break;
    case 1: dot_rows<1>(x + i * ldx, ldx, buf, kc, c + i * kBlockN, add); break;
    default: break;
  }
}

inline __mmask16 first_lanes(int64_t n) {  // the first min(n, 16) of 16 lanes
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// y's rows [0, rows) (row stride ldy), columns [0, cols <= kBlockN) = c (rows, kBlockN) float32 + bias
// (float32, or none), rounded once where y is bf16.
template <typename TOut>
inline void store_rows(const float* c, int64_t rows, const float* bias, TOut* y, int64_t ldy, int64_t cols) {
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 mask = first_lanes(cols - j);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + j) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + i * kBlockN + j), add);
      if constexpr (std::is_same_v<TOut, float>) {
        _mm512_mask_storeu_ps(y + i * ldy + j, mask, v);
      } else {
        _mm256_mask_storeu_epi16(y + i * ldy + j, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      }
    }
  }
}

#ifdef PAGEDSERVE_AMX_TILES
// Up to kTileRows rows (a decode step's batch) on the tile registers directly, instead of a brgemm call
// per slice of K: the float32 sums stay in tiles 0-3 (rows x 16 columns each) over the whole of K; x's
// rows are tile 4, read in place; the weight is de-quantized 32 inputs of a block at a time (`dequantize`)
// into one of two 4 KiB buffers and read from there as tiles 5 and 6 (16 pairs x 16 columns). The steps
// are pipelined: step s + 1 is de-quantized before step s's tile products are issued, so that the vector
// units can work while the tile unit multiplies, and step s's stores have had a step's time to drain
// before the tiles read them (for speed only: the core orders its own stores and tile loads). Against
// a brgemm call per 256 inputs (ATen's, which stores and reloads the sums at every call): 1.37-1.45x
// (int4) and 1.38-1.52x (int8) at 16 rows (docs/benchmarks.md, "Quantized decode batches on our own
// tiles"). Needs K a multiple of 32.
constexpr int64_t kTileRows = 16, kTileStepK = 32;

inline bool tiles_enabled() {  // PAGEDSERVE_CPU_QUANT_TILES=0 keeps ATen's brgemm there
  static const bool on = amx_tiles::env_on("PAGEDSERVE_CPU_QUANT_TILES");
  return on;
}

inline bool tile_rows(int64_t M, int64_t K) {
  return M <= kTileRows && K % kTileStepK == 0 && tiles_enabled() && amx_tiles::permitted();
}

inline void configure_tiles(int64_t rows) {
  amx_tiles::Config cfg;
  for (int t = 0; t < 5; ++t) cfg.tile(t, rows, 64);
  cfg.tile(5, 16, 64).tile(6, 16, 64);
  amx_tiles::configure(cfg);
}

// Blocks [begin, end) for x's rows (row stride ldx; configure_tiles(rows) done): `emit(b, c)` gets each
// block's sums c (rows, kBlockN) float32. bufs: 2 * kTileStepK * kBlockN bf16.
template <typename Emit>
inline void tile_blocks(const Weight& w, int64_t begin, int64_t end, const c10::BFloat16* x, int64_t ldx,
                        c10::BFloat16* bufs, float* c, const Emit& emit) {
  const int64_t steps_per_block = w.K / kTileStepK, steps = (end - begin) * steps_per_block;
  auto stage = [&](int64_t s) {  // de-quantize step s into its buffer
    dequantize(w, begin + s / steps_per_block, (s % steps_per_block) * kTileStepK, kTileStepK,
               bufs + (s % 2) * kTileStepK * kBlockN);
  };
  if (steps > 0) stage(0);
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k0 = (s % steps_per_block) * kTileStepK;
    if (k0 == 0) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    if (s + 1 < steps) stage(s + 1);
    // GCC's tile loads are asm with no memory operand: the stores into the buffers must stay above them.
    asm volatile("" : : : "memory");
    const c10::BFloat16* pairs = bufs + (s % 2) * kTileStepK * kBlockN;  // 16 pair rows, 2 * kBlockN apart
    _tile_loadd(4, x + k0, ldx * 2);
    _tile_loadd(5, pairs, kBlockN * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, pairs + 32, kBlockN * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, pairs + 64, kBlockN * 4);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, pairs + 96, kBlockN * 4);
    _tile_dpbf16ps(3, 4, 6);
    asm volatile("" : : : "memory");  // and the stores of step s + 2 below them
    if (k0 + kTileStepK == w.K) {
      _tile_stored(0, c, kBlockN * 4);
      _tile_stored(1, c + 16, kBlockN * 4);
      _tile_stored(2, c + 32, kBlockN * 4);
      _tile_stored(3, c + 48, kBlockN * 4);
      asm volatile("" : : : "memory");  // the reads of c after the stores
      emit(begin + s / steps_per_block, c);
    }
  }
}
#endif

#ifdef __AVX512VNNI__
// From past the few-row path (3 rows; 5 for a per-column int8 weight) on CPUs without AMX, with
// AVX512-VNNI, for a model that keeps int8 activations (`int8_activations`): up to kVnniRows rows (a
// decode batch) a group at a time (`vnni_block`), more (a prompt) in tiles of rows over whole column
// blocks (`vnni_tiles`, below). The activations are quantized to int8 per row and
// block of inputs (`int8_block`: the weight's group, or 32 where the group is a larger multiple of 32;
// symmetric, scale = the block's largest |x| / 127, rounded to nearest), and each 4 inputs of a column
// multiply as integers, `vpdpbusd`: 64 multiply-adds an instruction against `vdpbf16ps`'s 32, and the
// weight is never de-quantized, only unpacked to bytes.
// The weight is the unsigned operand: 4-bit values as they are (0..15); 6-bit ones as stored, q + 32
// (0..63), and 8-bit ones offset by 128 (q ^ 0x80), which each block's sum takes back as 32 or 128
// times the sum of its activations. Per row and
// block the integer sums are scaled once, s_x * scale * sum, and a min adds min * sum(s_x * a): the
// product of the de-quantized activations (a * s_x) and the weight, in float32. llama.cpp multiplies
// its 4-bit K-quants by int8 activations the same way (Q8_K). `PAGEDSERVE_CPU_QUANT_VNNI=0` keeps the
// AVX512-BF16 path there (A/B runs).
constexpr int64_t kVnniRows = 32;

inline bool vnni_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("PAGEDSERVE_CPU_QUANT_VNNI");
    return !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  return on;
}

// Whether this CPU takes the VNNI path: not where it has AMX tiles (the tile paths serve those rows, and
// a caller's tiles=false there means ATen's or our bf16 loop, as quant.vnni_rows() reports).
inline bool vnni_here() {
  static const bool here = vnni_enabled() && !brgemm_linear::available();
  return here;
}

// Whether the VNNI paths run at all (where vnni_here()): int8 activations are a model's choice, set
// once it is loaded (compute_service/model/activation_check.py: on where they measure close to bf16
// ones; a small model can sit on a near-tie they flip). One model a process: a process-wide setting.
inline std::atomic<bool>& int8_activations() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool int8_here() { return vnni_here() && int8_activations().load(std::memory_order_relaxed); }

// Whether `linear` takes the VNNI path for M rows of this weight (bf16 activations; groups of whole
// 16-input vectors, so the activations quantize a vector at a time).
inline bool vnni_rows(const Weight& w, int64_t M) {
  return M <= kVnniRows && w.group % 16 == 0 && int8_here();
}

// Inputs an activation scale covers: the weight's group, or 32 where the group is a larger multiple of
// 32 (an outlier then coarsens its own 32 inputs only, as llama.cpp's Q8_0 activations do).
inline int64_t int8_block(int64_t group) { return group > 32 && group % 32 == 0 ? 32 : group; }

// x (M, K) bf16 as int8 per row and block of int8_block(group) inputs: a (M, K), scale (M, K / block) =
// amax / 127, sum (M, K / block) of a, and per row and weight group the sum of the de-quantized
// activations, scale * sum over its blocks (group_sum (M, K / group): what a min multiplies).
struct Int8Rows {
  int64_t block = 0;
  std::vector<int8_t> a;
  std::vector<float> scale, group_sum;
  std::vector<int32_t> sum;
};

__attribute__((always_inline)) inline __m512 load16(const c10::BFloat16* p) { return widen16(p); }
__attribute__((always_inline)) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// Row `row` of `out` (sized for it: `size_rows`) from the K values at src (bf16 or float32), as above;
// with REST, also what each value leaves over its de-quantized one, src - scale * a, into rest (K).
template <bool REST, typename T>
inline void quantize_row(const T* src, int64_t K, int64_t group, Int8Rows& out, int64_t row, float* rest) {
  const int64_t block = out.block, blocks = K / block, per_group = group / block;
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t j = 0; j < blocks; ++j) {
    const T* at = src + j * block;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < block; k += 16) amax = _mm512_max_ps(amax, _mm512_and_ps(load16(at + k), sign_off));
    const float top = _mm512_reduce_max_ps(amax);
    const float inv = top > 0.0f ? 127.0f / top : 0.0f;
    const float scale = top / 127.0f;
    __m512i total = _mm512_setzero_si512();
    int8_t* dst = out.a.data() + row * K + j * block;
    for (int64_t k = 0; k < block; k += 16) {
      const __m512 v = load16(at + k);
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));  // nearest, ties even
      total = _mm512_add_epi32(total, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(q));
      if constexpr (REST) {
        _mm512_storeu_ps(rest + j * block + k, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale), v));
      }
    }
    const int32_t sum = _mm512_reduce_add_epi32(total);
    out.scale[row * blocks + j] = scale;
    out.sum[row * blocks + j] = sum;
    out.group_sum[row * (K / group) + j / per_group] += scale * static_cast<float>(sum);
  }
}

inline void size_rows(int64_t M, int64_t K, int64_t group, Int8Rows& out) {
  const int64_t block = int8_block(group);
  out.block = block;
  out.a.resize(M * K);
  out.scale.resize(M * (K / block));
  out.sum.resize(M * (K / block));
  out.group_sum.assign(M * (K / group), 0.0f);
}

inline void quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t group, Int8Rows& out) {
  size_rows(M, K, group, out);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_row<false>(x + i * K, K, group, out, i, nullptr);
  });
}

// x (M, K) float32 as 2M int8 rows: rows [0, M) x's own (as `quantize_rows`), rows [M, 2M) what those
// leave (rounded to float32 once), quantized again with their own scales: at most half the first's
// step / 127 each. A weight times the two, added, is the product with x to within 1/4 / 127^2 of each
// 32 inputs' largest (about 2^-16; bf16 rounds each value to within 2^-8 of itself). Non-finite x
// gives NaN products (inf - inf in the remainder).
inline void quantize_split(const float* x, int64_t M, int64_t K, int64_t group, Int8Rows& out) {
  size_rows(2 * M, K, group, out);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> rest(K);
    for (int64_t i = begin; i < end; ++i) {
      quantize_row<true>(x + i * K, K, group, out, i, rest.data());
      quantize_row<false>(rest.data(), K, group, out, M + i, nullptr);
    }
  });
}

// Column order of the unpacked byte registers (below): lane l of register X holds column order[X][l].
// 4 and 6 bits (as `fused_nibbles`): 16 (l / 4) + 4 X + l % 4; 8 bits: 8 (l / 4) + 32 (X / 2) + 4 (X % 2) + l % 4.
template <int BITS>
inline __m512i vnni_columns(int X) {
  alignas(64) int32_t idx[16];
  for (int l = 0; l < 16; ++l)
    idx[l] = BITS != 8 ? 16 * (l / 4) + 4 * X + l % 4 : 8 * (l / 4) + 32 * (X / 2) + 4 * (X % 2) + l % 4;
  return _mm512_load_si512(idx);
}

// Group g of block b's 64 scales (or mins: `at`) as four registers in the column order of `cols`.
inline void in_column_order(const Weight& w, const void* at, int64_t b, int64_t g, const __m512i cols[4], __m512 out[4]) {
  if (w.bits != 8) {  // 4 and 6 bits: `cols` is `group_x`'s order (compact scales are stored in it)
    group_x(w, at, b, g, out);
    return;
  }
  __m512 v[4];
  for (int k = 0; k < 4; ++k) v[k] = group16(w, at, b, g, k);
  for (int X = 0; X < 4; ++X) {
    const __mmask16 high = _mm512_cmpge_epi32_mask(cols[X], _mm512_set1_epi32(32));
    out[X] = _mm512_mask_blend_ps(high, _mm512_permutex2var_ps(v[0], cols[X], v[1]),
                                  _mm512_permutex2var_ps(v[2], cols[X], v[3]));
  }
}

// Quad q (inputs 4q..4q+3) of block b as unsigned bytes in 4 registers of 16 columns x 4 inputs (one
// dword a column, `vpdpbusd`'s layout), columns in `vnni_columns` order: the two pair rows 2q and 2q + 1
// interleaved by 16-bit words.
template <int BITS>
inline void unpack_quad(const uint8_t* q, int64_t quad, __m512i W[4]) {
  if constexpr (BITS == 6) {  // u = q + 32 as it is; the sums take 32 times the activations' back
    const uint8_t* row = q + 2 * quad * 96;  // pair rows of 96 bytes
    for (int h = 0; h < 3; ++h) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch + 64 * h, _MM_HINT_T0);
    __m512i lo0, hi0, lo1, hi1;
    six_bit_pair(row, lo0, hi0);
    six_bit_pair(row + 96, lo1, hi1);
    W[0] = _mm512_unpacklo_epi16(lo0, lo1);
    W[1] = _mm512_unpackhi_epi16(lo0, lo1);
    W[2] = _mm512_unpacklo_epi16(hi0, hi1);
    W[3] = _mm512_unpackhi_epi16(hi0, hi1);
  } else if constexpr (BITS == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const uint8_t* row = q + 2 * quad * kBlockN;  // pair rows of kBlockN bytes
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch + 64, _MM_HINT_T0);
    const __m512i p0 = _mm512_loadu_si512(row), p1 = _mm512_loadu_si512(row + kBlockN);
    const __m512i lo0 = _mm512_and_si512(p0, nibble), hi0 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), nibble);
    const __m512i lo1 = _mm512_and_si512(p1, nibble), hi1 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), nibble);
    W[0] = _mm512_unpacklo_epi16(lo0, lo1);
    W[1] = _mm512_unpackhi_epi16(lo0, lo1);
    W[2] = _mm512_unpacklo_epi16(hi0, hi1);
    W[3] = _mm512_unpackhi_epi16(hi0, hi1);
  } else {
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    const uint8_t* row = q + 2 * quad * 2 * kBlockN;  // pair rows of 2 kBlockN bytes
    for (int h = 0; h < 4; ++h) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch + 64 * h, _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {  // columns 32 half .. + 31
      const __m512i p0 = _mm512_xor_si512(_mm512_loadu_si512(row + 64 * half), offset);
      const __m512i p1 = _mm512_xor_si512(_mm512_loadu_si512(row + 2 * kBlockN + 64 * half), offset);
      W[2 * half] = _mm512_unpacklo_epi16(p0, p1);
      W[2 * half + 1] = _mm512_unpackhi_epi16(p0, p1);
    }
  }
}

// The integer sums of MR rows over one activation block (`block_quads` quads from quad u0) of the
// unpacked weight in wq (4 registers a quad): part[i][X] for row i's 16 columns of register X. Kept
// apart from the float accumulators, so that the 4 MR sums, the quad's 4 weight registers and the
// broadcast stay in registers (with the float sums live too, 32 and more, GCC spilled and shuffled).
template <int MR, int QUADS>
__attribute__((always_inline)) inline void vnni_sums(const __m512i* wq, int64_t u0, int64_t block_quads,
                                                    const int8_t* a, int64_t lda, __m512i part[MR][4]) {
  for (int i = 0; i < MR; ++i)
    for (int X = 0; X < 4; ++X) part[i][X] = _mm512_setzero_si512();
  const int64_t n = QUADS > 0 ? QUADS : block_quads;
#pragma GCC unroll 8
  for (int64_t u = u0; u < u0 + n; ++u) {
    const __m512i W0 = wq[4 * u], W1 = wq[4 * u + 1], W2 = wq[4 * u + 2], W3 = wq[4 * u + 3];
    for (int i = 0; i < MR; ++i) {
      int32_t quad_bits;
      std::memcpy(&quad_bits, a + i * lda + 4 * u, sizeof(quad_bits));
      const __m512i xv = _mm512_set1_epi32(quad_bits);
      part[i][0] = _mm512_dpbusd_epi32(part[i][0], W0, xv);
      part[i][1] = _mm512_dpbusd_epi32(part[i][1], W1, xv);
      part[i][2] = _mm512_dpbusd_epi32(part[i][2], W2, xv);
      part[i][3] = _mm512_dpbusd_epi32(part[i][3], W3, xv);
    }
  }
}

// vnni_sums for 4 rows and 8 quads (the decode batches' case), its 16 sums as named variables: with an
// array GCC 12 kept them in registers but copied each one to another register every quad.
__attribute__((always_inline)) inline void vnni_sums_4x8(const __m512i* wq, int64_t u0, const int8_t* a, int64_t lda,
                                                        __m512i part[4][4]) {
  __m512i s00 = _mm512_setzero_si512(), s01 = s00, s02 = s00, s03 = s00, s10 = s00, s11 = s00, s12 = s00, s13 = s00;
  __m512i s20 = s00, s21 = s00, s22 = s00, s23 = s00, s30 = s00, s31 = s00, s32 = s00, s33 = s00;
  const int8_t* a0 = a + 4 * u0;
  const __m512i* w = wq + 4 * u0;
#define PS_VNNI_ROW(I, P)                                                    \
  {                                                                        \
    int32_t bits;                                                          \
    std::memcpy(&bits, a0 + (I) * lda + 4 * u, sizeof(bits));              \
    const __m512i xv = _mm512_set1_epi32(bits);                            \
    P##0 = _mm512_dpbusd_epi32(P##0, W0, xv);                              \
    P##1 = _mm512_dpbusd_epi32(P##1, W1, xv);                              \
    P##2 = _mm512_dpbusd_epi32(P##2, W2, xv);                              \
    P##3 = _mm512_dpbusd_epi32(P##3, W3, xv);                              \
  }
#pragma GCC unroll 8
  for (int u = 0; u < 8; ++u) {
    const __m512i W0 = w[4 * u], W1 = w[4 * u + 1], W2 = w[4 * u + 2], W3 = w[4 * u + 3];
    PS_VNNI_ROW(0, s0)
    PS_VNNI_ROW(1, s1)
    PS_VNNI_ROW(2, s2)
    PS_VNNI_ROW(3, s3)
  }
#undef PS_VNNI_ROW
  part[0][0] = s00; part[0][1] = s01; part[0][2] = s02; part[0][3] = s03;
  part[1][0] = s10; part[1][1] = s11; part[1][2] = s12; part[1][3] = s13;
  part[2][0] = s20; part[2][1] = s21; part[2][2] = s22; part[2][3] = s23;
  part[3][0] = s30; part[3][1] = s31; part[3][2] = s32; part[3][3] = s33;
}

// c (MR, kBlockN) float32 in `vnni_columns` order (+)= rows [0, MR) of the int8 activations (row stride
// lda, from the group's first input) times one group of the weight, unpacked in wq (4 registers a quad),
// `quads` of them in blocks of `block_quads` (an activation scale each: sx, sumx, row stride `blocks`);
// xmin: each row's group_sum (row stride `groups`), for the mins. Each block's integer sums are scaled
// into c in memory (L1), not into registers held across the block.
template <int BITS, int MR>
inline void vnni_group(const __m512i* wq, int64_t quads, int64_t block_quads, const int8_t* a, int64_t lda,
                       const float* sx, const int32_t* sumx, int64_t blocks, const float* xmin, int64_t groups,
                       const __m512 scale[4], const __m512* minimum, float* c) {
  for (int64_t u0 = 0, j = 0; u0 < quads; u0 += block_quads, ++j) {
    __m512i part[MR][4];
    if constexpr (MR == 4) {
      if (block_quads == 8) vnni_sums_4x8(wq, u0, a, lda, part);
      else vnni_sums<MR, 0>(wq, u0, block_quads, a, lda, part);
    } else if (block_quads == 8) {  // activation blocks of 32 inputs: the usual case, unrolled
      vnni_sums<MR, 8>(wq, u0, block_quads, a, lda, part);
    } else {
      vnni_sums<MR, 0>(wq, u0, block_quads, a, lda, part);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 s = _mm512_set1_ps(sx[i * blocks + j]);
      const __m512i offset = _mm512_set1_epi32((BITS == 8 ? 128 : 32) * sumx[i * blocks + j]);
      for (int X = 0; X < 4; ++X) {
        const __m512i sum = BITS != 4 ? _mm512_sub_epi32(part[i][X], offset) : part[i][X];
        float* at = c + i * kBlockN + 16 * X;
        _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), s), scale[X], _mm512_loadu_ps(at)));
      }
      // A row at a time: else GCC loads all 16 float sums at once, spills them and copies them back.
      asm volatile("" ::: "memory");
    }
  }
  if (!minimum) return;
  for (int i = 0; i < MR; ++i) {
    const __m512 min_x = _mm512_set1_ps(xmin[i * groups]);
    for (int X = 0; X < 4; ++X) {
      float* at = c + i * kBlockN + 16 * X;
      _mm512_storeu_ps(at, _mm512_fmadd_ps(minimum[X], min_x, _mm512_loadu_ps(at)));
    }
  }
}

// Where each column of the natural order sits in the `vnni_columns<BITS>` registers: natural register c,
// lane j (column 16c + j) is lane idx[c] & 15 of register (high[c] set: 2, else 0) + (idx[c] >> 4), so
// two two-source permutes and a blend bring four registers back to the natural order.
template <int BITS>
struct NaturalOrder {
  __m512i idx[4];
  __mmask16 high[4];
  NaturalOrder() {
    alignas(64) int32_t order[4][16], position[kBlockN];
    for (int X = 0; X < 4; ++X) _mm512_store_si512(order[X], vnni_columns<BITS>(X));
    for (int X = 0; X < 4; ++X)
      for (int l = 0; l < 16; ++l) position[order[X][l]] = 16 * X + l;
    for (int c = 0; c < 4; ++c) {
      alignas(64) int32_t lanes[16];
      high[c] = 0;
      for (int j = 0; j < 16; ++j) {
        lanes[j] = position[16 * c + j] & 31;
        if (position[16 * c + j] >= 32) high[c] = static_cast<__mmask16>(high[c] | (1u << j));
      }
      idx[c] = _mm512_load_si512(lanes);
    }
  }
  // c (kBlockN floats) in the natural order = the four registers in `vnni_columns` order.
  __attribute__((always_inline)) void store(__m512 r0, __m512 r1, __m512 r2, __m512 r3, float* c) const {
    for (int k = 0; k < 4; ++k)
      _mm512_storeu_ps(c + 16 * k, _mm512_mask_blend_ps(high[k], _mm512_permutex2var_ps(r0, idx[k], r1),
                                                        _mm512_permutex2var_ps(r2, idx[k], r3)));
  }
};

// c (M, kBlockN) float32, natural column order = the int8 rows times block b (M <= kVnniRows). Per group,
// the weight is unpacked once into wq (group x 64 bytes: L1 up to groups of 256; a per-column weight's
// whole K from L2) and every row multiplies by it, four rows a pass.
template <int BITS>
inline void vnni_block(const Weight& w, int64_t b, const Int8Rows& x, int64_t M, __m512i* wq, float* acc, float* c) {
  const uint8_t* q = w.q + b * w.block_bytes();
  const int64_t groups = w.groups(), quads = w.group / 4, K = w.K, blocks = K / x.block, per_group = w.group / x.block;
  __m512i cols[4];
  for (int X = 0; X < 4; ++X) cols[X] = vnni_columns<BITS>(X);
  std::fill(acc, acc + M * kBlockN, 0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t u = 0; u < quads; ++u) unpack_quad<BITS>(q, g * quads + u, wq + 4 * u);
    __m512 scale[4], minimum[4];
    in_column_order(w, w.scales, b, g, cols, scale);
    if (w.mins) in_column_order(w, w.mins, b, g, cols, minimum);
    const __m512* mins = w.mins ? minimum : nullptr;
    const int8_t* a = x.a.data() + g * w.group;
    const float* sx = x.scale.data() + g * per_group;
    const int32_t* sumx = x.sum.data() + g * per_group;
    const float* xmin = x.group_sum.data() + g;
    const auto pass = [&](auto rows, int64_t i) {
      vnni_group<BITS, decltype(rows)::value>(wq, quads, x.block / 4, a + i * K, K, sx + i * blocks, sumx + i * blocks,
                                              blocks, xmin + i * groups, groups, scale, mins, acc + i * kBlockN);
    };
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) pass(std::integral_constant<int, 4>{}, i);
    switch (M - i) {
      case 3: pass(std::integral_constant<int, 3>{}, i); break;
      case 2: pass(std::integral_constant<int, 2>{}, i); break;
      case 1: pass(std::integral_constant<int, 1>{}, i); break;
      default: break;
    }
  }
  static const NaturalOrder<BITS> natural;
  for (int64_t i = 0; i < M; ++i) {
    const float* v = acc + i * kBlockN;
    natural.store(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16), _mm512_loadu_ps(v + 32), _mm512_loadu_ps(v + 48),
                  c + i * kBlockN);
  }
}

// One column block's operands for `vnni_tile`, prepared once per block and read by every tile of rows:
// the whole of K unpacked (K / 4 quads x 4 registers: K x 64 bytes, L2), and each group's scales (and
// mins) as float32 in the registers' column order (groups x 64).
struct VnniOperands {
  std::vector<__m512i> wq;
  std::vector<float> scales, mins;

  template <int BITS>
  void prepare(const Weight& w, int64_t b) {
    const uint8_t* q = w.q + b * w.block_bytes();
    wq.resize(w.K);
    for (int64_t u = 0; u < w.K / 4; ++u) unpack_quad<BITS>(q, u, wq.data() + 4 * u);
    __m512i cols[4];
    for (int X = 0; X < 4; ++X) cols[X] = vnni_columns<BITS>(X);
    scales.resize(w.groups() * kBlockN);
    if (w.mins) mins.resize(w.groups() * kBlockN);
    for (int64_t g = 0; g < w.groups(); ++g) {
      __m512 v[4];
      in_column_order(w, w.scales, b, g, cols, v);
      for (int X = 0; X < 4; ++X) _mm512_storeu_ps(scales.data() + g * kBlockN + 16 * X, v[X]);
      if (!w.mins) continue;
      in_column_order(w, w.mins, b, g, cols, v);
      for (int X = 0; X < 4; ++X) _mm512_storeu_ps(mins.data() + g * kBlockN + 16 * X, v[X]);
    }
  }
};

// c (MR, kBlockN) float32, natural column order = rows [i0, i0 + MR) of the int8 activations times the
// prepared block (MR <= 3). The 4 MR float sums stay in registers over the whole of K (named: arrays of
// registers GCC 12 copies at every step); per activation block, 4 MR integer sums of QUADS quads (0: the
// block's own count), then each scaled into its float sum: t = sum * s_x - offset * s_x * sum(a) (6 and 8
// bits: the weight's stored offset, 32 or 128, taken back), sum += t * scale; per group with mins,
// sum += min * the group's de-quantized activations. 12 sums, 4 weight registers and a broadcast: 29 of
// 32 registers. The scaling's 3-4 vector operations per 8 `vpdpbusd` bound it: 60-74% of that
// instruction's peak by weight format (docs/benchmarks.md, "Quantized prompts on int8 tiles").
template <int BITS, int MR, int QUADS>
inline void vnni_tile(const VnniOperands& op, const Weight& w, const Int8Rows& x, int64_t i0, float* c) {
  const int64_t K = w.K, block_quads = x.block / 4, blocks = K / x.block, per_group = w.group / x.block;
  const int64_t groups = w.groups(), n = QUADS > 0 ? QUADS : block_quads;
  constexpr float offset = BITS == 8 ? 128.0f : BITS == 6 ? 32.0f : 0.0f;
  const int8_t* a0 = x.a.data() + i0 * K;
  const int8_t* a1 = a0 + (MR > 1 ? K : 0);
  const int8_t* a2 = a0 + (MR > 2 ? 2 * K : 0);
  __m512 f00 = _mm512_setzero_ps(), f01 = f00, f02 = f00, f03 = f00, f10 = f00, f11 = f00, f12 = f00, f13 = f00;
  __m512 f20 = f00, f21 = f00, f22 = f00, f23 = f00;
#define PS_DP(P, A)                                                       \
  {                                                                       \
    int32_t bits;                                                         \
    std::memcpy(&bits, (A) + 4 * u, sizeof(bits));                        \
    const __m512i xv = _mm512_set1_epi32(bits);                           \
    P##0 = _mm512_dpbusd_epi32(P##0, W0, xv);                             \
    P##1 = _mm512_dpbusd_epi32(P##1, W1, xv);                             \
    P##2 = _mm512_dpbusd_epi32(P##2, W2, xv);                             \
    P##3 = _mm512_dpbusd_epi32(P##3, W3, xv);                             \
  }
#define PS_SCALE(P, F, R)                                                                           \
  {                                                                                                 \
    const float s = x.scale[(i0 + (R)) * blocks + j];                                               \
    const __m512 sx = _mm512_set1_ps(s), back = _mm512_set1_ps(-offset * s * x.sum[(i0 + (R)) * blocks + j]); \
    F##0 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(P##0), sx, back), _mm512_loadu_ps(ws), F##0);      \
    F##1 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(P##1), sx, back), _mm512_loadu_ps(ws + 16), F##1); \
    F##2 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(P##2), sx, back), _mm512_loadu_ps(ws + 32), F##2); \
    F##3 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(P##3), sx, back), _mm512_loadu_ps(ws + 48), F##3); \
  }
#define PS_MIN(F, R)                                                                  \
  {                                                                                   \
    const __m512 xm = _mm512_set1_ps(x.group_sum[(i0 + (R)) * groups + g]);           \
    F##0 = _mm512_fmadd_ps(_mm512_loadu_ps(wm), xm, F##0);                            \
    F##1 = _mm512_fmadd_ps(_mm512_loadu_ps(wm + 16), xm, F##1);                       \
    F##2 = _mm512_fmadd_ps(_mm512_loadu_ps(wm + 32), xm, F##2);                       \
    F##3 = _mm512_fmadd_ps(_mm512_loadu_ps(wm + 48), xm, F##3);                       \
  }
  for (int64_t j = 0, g = 0, in_group = 0; j < blocks; ++j) {
    __m512i p00 = _mm512_setzero_si512(), p01 = p00, p02 = p00, p03 = p00, p10 = p00, p11 = p00, p12 = p00;
    __m512i p13 = p00, p20 = p00, p21 = p00, p22 = p00, p23 = p00;
    const __m512i* wj = op.wq.data() + 4 * j * block_quads;
    const int64_t k0 = j * x.block;
#pragma GCC unroll 8
    for (int64_t u = 0; u < n; ++u) {
      __m512i W0 = wj[4 * u], W1 = wj[4 * u + 1], W2 = wj[4 * u + 2], W3 = wj[4 * u + 3];
      // Held in registers: else GCC loads them again for every row (the load port, not the multiplies,
      // then bounds the loop).
      asm("" : "+v"(W0), "+v"(W1), "+v"(W2), "+v"(W3));
      PS_DP(p0, a0 + k0)
      if constexpr (MR > 1) PS_DP(p1, a1 + k0)
      if constexpr (MR > 2) PS_DP(p2, a2 + k0)
    }
    const float* ws = op.scales.data() + g * kBlockN;
    PS_SCALE(p0, f0, 0)
    if constexpr (MR > 1) PS_SCALE(p1, f1, 1)
    if constexpr (MR > 2) PS_SCALE(p2, f2, 2)
    if (++in_group < per_group) continue;
    if (w.mins) {
      const float* wm = op.mins.data() + g * kBlockN;
      PS_MIN(f0, 0)
      if constexpr (MR > 1) PS_MIN(f1, 1)
      if constexpr (MR > 2) PS_MIN(f2, 2)
    }
    in_group = 0;
    ++g;
  }
#undef PS_DP
#undef PS_SCALE
#undef PS_MIN
  static const NaturalOrder<BITS> natural;
  natural.store(f00, f01, f02, f03, c);
  if constexpr (MR > 1) natural.store(f10, f11, f12, f13, c + kBlockN);
  if constexpr (MR > 2) natural.store(f20, f21, f22, f23, c + 2 * kBlockN);
}

// c rows of the block for rows [i0, i0 + MR), the activation blocks' quad count as a constant where it
// is one of the usual (8: blocks of 32 inputs; 4: of 16, Q6_K's groups).
template <int BITS, int MR>
inline void vnni_tile_any(const VnniOperands& op, const Weight& w, const Int8Rows& x, int64_t i0, float* c) {
  if (x.block == 32) vnni_tile<BITS, MR, 8>(op, w, x, i0, c);
  else if (x.block == 16) vnni_tile<BITS, MR, 4>(op, w, x, i0, c);
  else vnni_tile<BITS, MR, 0>(op, w, x, i0, c);
}

// c's rows [0, rows) += the `rows` rows at `more` (both (rows, kBlockN)): x's two int8 parts' products.
inline void add_rows(float* c, const float* more, int64_t rows) {
  for (int64_t k = 0; k < rows * kBlockN; k += 16)
    _mm512_storeu_ps(c + k, _mm512_add_ps(_mm512_loadu_ps(c + k), _mm512_loadu_ps(more + k)));
}

// y's columns of block b for M rows, three rows a tile. With `split` (float32 activations as
// `quantize_split`'s 2M rows), each tile of rows [i, i + 3) adds the tile of their remainders at M + i.
template <int BITS, typename TOut>
inline void vnni_tiles(VnniOperands& op, const Weight& w, int64_t b, const Int8Rows& x, int64_t M, const float* bias,
                       TOut* y, int64_t N, bool split = false) {
  op.prepare<BITS>(w, b);
  const int64_t n0 = b * kBlockN, cols = std::min(kBlockN, N - n0);
  alignas(64) float c[3 * kBlockN], more[3 * kBlockN];
  const auto tile = [&](auto rows, int64_t i) {
    constexpr int MR = decltype(rows)::value;
    vnni_tile_any<BITS, MR>(op, w, x, i, c);
    if (split) {
      vnni_tile_any<BITS, MR>(op, w, x, M + i, more);
      add_rows(c, more, MR);
    }
    store_rows(c, MR, bias ? bias + n0 : nullptr, y + i * N + n0, N, cols);
  };
  int64_t i = 0;
  for (; i + 3 <= M; i += 3) tile(std::integral_constant<int, 3>{}, i);
  if (M - i == 2) tile(std::integral_constant<int, 2>{}, i);
  if (M - i == 1) tile(std::integral_constant<int, 1>{}, i);
}

// Whether `linear` takes the VNNI tiles for M rows of this weight: more than the decode batches' VNNI
// path takes (a prompt's rows), on the CPUs that path runs on.
inline bool vnni_tile_rows(const Weight& w, int64_t M) {
  return M > kVnniRows && w.group % 16 == 0 && int8_here();
}

// The calling thread's int8 activations of a prompt (a 2,048-token chunk's are ~25 MB at 8,960 inputs),
// kept from call to call: fresh, a call would pay their page faults. `release_prompt_rows` hands them
// back (the engine does when idle).
inline Int8Rows& prompt_rows() {
  thread_local Int8Rows kept;
  return kept;
}

inline void release_prompt_rows() { prompt_rows() = Int8Rows{}; }

// f(std::integral_constant<int, w.bits>): a kernel instantiated for the weight's width.
template <typename F>
inline void by_bits(const Weight& w, F&& f) {
  if (w.bits == 8) f(std::integral_constant<int, 8>{});
  else if (w.bits == 6) f(std::integral_constant<int, 6>{});
  else f(std::integral_constant<int, 4>{});
}

// y (M, N) = the int8 rows xq times W (+ bias), the threads claiming column blocks: up to kVnniRows
// int8 rows a group at a time (`vnni_block`, a decode batch's), more in tiles of rows over whole blocks
// (`vnni_tiles`, a prompt's). With `split`, xq holds 2M rows (`quantize_split`): each row's product is
// its own plus its remainder's.
template <typename TOut>
inline void vnni_linear(const Weight& w, const Int8Rows& xq, int64_t M, bool split, const float* bias, TOut* y,
                        int64_t N) {
  static_assert(kBlockM >= kVnniRows, "vnni_block's rows fill c");
  const int64_t rows = split ? 2 * M : M;
  const int64_t blocks = std::min(w.blocks, (N + kBlockN - 1) / kBlockN);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  claims::Claims blocks_left(blocks, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if (rows > kVnniRows) {
      thread_local VnniOperands op;
      blocks_left.each([&](int64_t b) {
        by_bits(w, [&](auto bits) { vnni_tiles<decltype(bits)::value>(op, w, b, xq, M, bias, y, N, split); });
      });
      return;
    }
    alignas(64) float c[kBlockM * kBlockN];  // a block's outputs for every int8 row (written before read)
    std::vector<__m512i> wq(w.group);         // a group's quads, unpacked: group / 4 x 4 registers
    std::vector<float> acc(rows * kBlockN);
    blocks_left.each([&](int64_t b) {
      const int64_t n0 = b * kBlockN;
      by_bits(w, [&](auto bits) { vnni_block<decltype(bits)::value>(w, b, xq, rows, wq.data(), acc.data(), c); });
      if (split) add_rows(c, c + M * kBlockN, M);
      store_rows(c, M, bias ? bias + n0 : nullptr, y + n0, N, std::min(kBlockN, N - n0));
    });
  });
}

// `linear` on the VNNI tiles: x quantized to int8 once (`prompt_rows`), then the threads claim column
// blocks.
template <typename TOut>
inline void linear_vnni_tiles(const Weight& w, const c10::BFloat16* x, const float* bias, TOut* y, int64_t M,
                              int64_t N) {
  Int8Rows& xq = prompt_rows();  // (a thread_local named in the lambda below would be each worker's own)
  quantize_rows(x, M, w.K, w.group, xq);
  vnni_linear(w, xq, M, false, bias, y, N);
}

// Whether `linear_float` takes float32 activations for this weight here: groups of whole 16-input
// vectors, in a build with AVX512-BF16 and AVX512-VNNI (on AMX CPUs too: their tiles take bf16 only),
// unless PAGEDSERVE_CPU_QUANT_VNNI=0; else the weight is widened to float32 (`quant_linear_op`).
inline bool float_rows(const Weight& w) { return vnni_enabled() && w.group % 16 == 0; }
#endif  // __AVX512VNNI__

// `linear` for many rows (M >= kOnednnRows, K a multiple of 32), bf16 outputs: the threads claim
// chunks of the column blocks (kChunkBlocks, fewer where the blocks are few for the threads), widen
// each into plain bf16 rows and multiply on oneDNN's matmul (at::mm_out; inside the parallel region
// oneDNN runs on that thread alone), writing into y's columns; products in float32 rounded to bf16 by
// oneDNN, then a float32 bias added and rounded again (a bias rounded to bf16 first would lose more).
inline void linear_onednn(const Weight& w, const c10::BFloat16* x, const float* bias, c10::BFloat16* y, int64_t M,
                          int64_t N) {
  const int64_t K = w.K, blocks = std::min(w.blocks, (N + kBlockN - 1) / kBlockN);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  const at::Tensor xt = at::from_blob(const_cast<c10::BFloat16*>(x), {M, K}, at::kBFloat16);
  // Chunks of `chunk` blocks, claimed by the threads (claims.h: a thread preempted for a moment holds
  // up the call by its last chunk only, not by its fixed share); never fewer chunks than threads.
  const int64_t chunk = std::min(kChunkBlocks, (blocks + threads - 1) / threads);
  claims::Claims chunks_left((blocks + chunk - 1) / chunk, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Scratch kept by each thread from call to call: a fresh multi-MB buffer a call costs page faults.
    thread_local std::vector<c10::BFloat16> plain, product, tmp;
    plain.resize(std::max<size_t>(plain.size(), kChunkBlocks * kBlockN * K));
    tmp.resize(32 * kBlockN);
    if (bias) product.resize(std::max<size_t>(product.size(), M * kChunkBlocks * kBlockN));
    chunks_left.each([&](int64_t index) {
      const int64_t b0 = index * chunk;
      const int64_t n0 = b0 * kBlockN, cols = std::min(std::min(chunk, blocks - b0) * kBlockN, N - n0);
      for (int64_t b = b0; b * kBlockN < n0 + cols; ++b) dequantize_plain(w, b, plain.data() + (b - b0) * kBlockN * K, tmp.data());
      at::Tensor out = bias ? at::from_blob(product.data(), {M, cols}, at::kBFloat16)
                            : at::from_blob(y + n0, {M, cols}, {N, 1}, at::kBFloat16);
      at::mm_out(out, xt, at::from_blob(plain.data(), {cols, K}, at::kBFloat16).t());
      if (!bias) return;  // (the next chunk)
      const c10::BFloat16* src = product.data();
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < cols; j += 16) {
          const __mmask16 mask = first_lanes(cols - j);
          const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src + i * cols + j)), 16));
          const __m512 sum = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0 + j));
          _mm256_mask_storeu_epi16(y + i * N + n0 + j, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
        }
      }
    });
  });
}

// y (M, N) = x (M, K) bf16 @ W^T (+ bias (N,) float32); W's first N of blocks * kBlockN columns.
// `tiles`: the AMX path (only where brgemm_linear::available()).
template <typename TOut>
inline void linear(const Weight& w, const c10::BFloat16* x, const float* bias, TOut* y, int64_t M, int64_t N,
                   bool tiles) {
  const int64_t K = w.K;
#ifdef __AVX512VNNI__
  if (!tiles && vnni_tile_rows(w, M)) return linear_vnni_tiles(w, x, bias, y, M, N);
#endif
  if constexpr (std::is_same_v<TOut, c10::BFloat16>) {
    if (M >= kOnednnRows && K % 32 == 0) return linear_onednn(w, x, bias, y, M, N);
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), w.blocks));
  // All rows in one pass: K in L1-sized slices, each de-quantized once and used at once. More rows: the
  // block's whole K de-quantized once (L2), then passes of kBlockM rows over it.
  const bool one_pass = M <= kBlockM;
  const int64_t slice = one_pass ? std::min(K, kSliceK) : K;
  // Few rows: de-quantized in registers and used at once (`fused`), without a buffer; one symmetric
  // scale per column leaves the integers unscaled until the sum.
  const bool grouped = by_group(w);
  const bool few = M <= fused_rows(w);
  // The grouped few-row paths add each group's min times the group's sum of x: those sums, once.
  std::vector<float> xsum;
  if (few && grouped) {
    xsum.resize(M * w.groups());
    group_sums(x, M, K, w.group, xsum.data());
  }
#ifdef PAGEDSERVE_AMX_TILES
  const bool own_tiles = tiles && !few && tile_rows(M, K);
#endif
#ifdef __AVX512VNNI__
  if (!few && !tiles && vnni_rows(w, M)) {  // a decode batch on int8 activations
    Int8Rows xq;
    quantize_rows(x, M, K, w.group, xq);
    return vnni_linear(w, xq, M, false, bias, y, N);
  }
#endif
#ifdef PAGEDSERVE_AMX_TILES
  if (own_tiles) {
    at::parallel_for(0, w.blocks, (w.blocks + threads - 1) / threads, [&](int64_t begin, int64_t end) {
      configure_tiles(M);
      const amx_tiles::Release release;
      alignas(64) float sums[kTileRows * kBlockN];
      thread_local std::vector<c10::BFloat16> bufs(2 * kTileStepK * kBlockN);
      const int64_t last = std::max(begin, std::min(end, (N + kBlockN - 1) / kBlockN));  // blocks holding outputs
      tile_blocks(w, begin, last, x, K, bufs.data(), sums, [&](int64_t b, const float* c) {
        const int64_t n0 = b * kBlockN;
        store_rows(c, M, bias ? bias + n0 : nullptr, y + n0, N, std::min(kBlockN, N - n0));
      });
    });
    return;
  }
#endif
  // The blocks holding outputs, claimed by the threads (claims.h: a preempted thread holds up the call
  // by its last claim only, not by a fixed half).
  claims::Claims blocks_left(std::min(w.blocks, (N + kBlockN - 1) / kBlockN), threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    alignas(64) float c[kBlockM * kBlockN];  // a block's outputs for up to kBlockM rows (written before read)
    // The de-quantized slice (not for few rows, which de-quantize in registers), left unfilled: a
    // std::vector would fill it element by element at every call.
    std::unique_ptr<c10::BFloat16[]> buf(few ? nullptr : new c10::BFloat16[slice * kBlockN]);
    blocks_left.each([&](int64_t b) {
      const int64_t n0 = b * kBlockN, cols = std::min(kBlockN, N - n0);
      auto emit = [&](int64_t m0, int64_t rows) {
        store_rows(c, rows, bias ? bias + n0 : nullptr, y + m0 * N + n0, N, cols);
      };
      if (few) {
        if (w.bits == 8) {
          grouped ? fused<8, true>(w, b, x, K, M, xsum.data(), c) : fused<8, false>(w, b, x, K, M, nullptr, c);
        } else if (w.bits == 6) {
          fused<6, true>(w, b, x, K, M, xsum.data(), c);
        } else {
          fused<4, true>(w, b, x, K, M, xsum.data(), c);
        }
        emit(0, M);
      } else if (one_pass) {
        for (int64_t k0 = 0; k0 < K; k0 += slice) {
          const int64_t kc = std::min(slice, K - k0);
          dequantize(w, b, k0, kc, buf.get());
          multiply(x + k0, K, buf.get(), kc, M, c, k0 > 0, tiles);
        }
        emit(0, M);
      } else {
        dequantize(w, b, 0, K, buf.get());
        for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
          const int64_t rows = std::min(kBlockM, M - m0);
          multiply(x + m0 * K, K, buf.get(), K, rows, c, false, tiles);
          emit(m0, rows);
        }
      }
    });
    if (tiles) at::native::cpublas::brgemm_release(true);
  });
}

#ifdef __AVX512VNNI__
// y (M, N) float32 = x (M, K) float32 @ W^T (+ bias): a float32 model's linears on its quantized weights
// (`float_rows(w)`), the integers multiplied as they are. Where two rows a row still fit the few-row
// path (one row; two with one scale per column), each row goes as two bf16 rows, its rounding to bf16
// and what that leaves (x - hi is exact in float32; rounded, within 2^-8 of itself: each value to
// within 2^-16), on `fused`. More rows go to int8 twice (`quantize_split`: itself, then what that
// leaves) and the VNNI kernels multiply the 2M rows (`vnni_linear`), each row's two products added:
// twice the int8 work of bf16 activations' path, the weight read once. Non-finite x gives NaN.
inline void linear_float(const Weight& w, const float* x, const float* bias, float* y, int64_t M, int64_t N) {
  if (2 * M > fused_rows(w)) {
    Int8Rows& xq = prompt_rows();
    quantize_split(x, M, w.K, w.group, xq);
    return vnni_linear(w, xq, M, true, bias, y, N);
  }
  const int64_t K = w.K;
  thread_local std::vector<c10::BFloat16> parts;
  thread_local std::vector<float> both;
  parts.resize(2 * M * K);
  both.resize(2 * M * N);
  for (int64_t i = 0; i < M * K; i += 16) {  // K: a whole number of 16-input vectors (float_rows)
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i hi = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    const __m512 high = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts.data() + i), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts.data() + M * K + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(v, high))));
  }
  linear(w, parts.data(), nullptr, both.data(), 2 * M, N, false);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 mask = first_lanes(N - j);
      __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, both.data() + i * N + j),
                               _mm512_maskz_loadu_ps(mask, both.data() + (M + i) * N + j));
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j));
      _mm512_mask_storeu_ps(y + i * N + j, mask, v);
    }
  }
}
#endif  // __AVX512VNNI__

#endif  // __AVX512BF16__

}  // namespace quant_linear
}  // namespace
