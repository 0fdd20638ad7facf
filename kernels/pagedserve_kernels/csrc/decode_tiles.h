// Decode attention on AMX tiles for grouped-query models (bf16 K/V, CPUs with AMX-BF16, builds whose
// flags enable AMX: -march=native on such a CPU), included by paged_attention_avx512.h inside
// namespace avx512_attention. `run_decode_item` sends it the blocks of single-position decodes whose
// KV heads have kMinGroup or more query heads (`takes`, `run_blocks`).
//
// Why: the AVX-512 decode kernel (decode_block_pairs) does its multiply-adds per query head, so its
// work per byte of K/V grows with the group. At the 1.5B GGUF's groups of 6 (head dim 128) it read
// 9-12 GB/s where the default model's groups of 3 read 15-18 (docs/benchmarks.md, "Decode attention
// on AMX tiles"). On tiles, one instruction multiplies a block's 16 tokens by all the group's heads.
//
// Two kernels, per block and KV head (R = the group's query heads, rows of the products); both compute
//   S^T (16 tokens x R) = K (16 x 32 of D, read in place from the pool) . Q^T pairs, D / 32 steps,
// and enter each weight p into P V as two bf16, p = hi + lo (as decode_block_pairs does):
//  - block_per_head (groups of kMinGroup to kMaxPerHeadGroup): the softmax per head with the tokens
//    in lanes, V read in place as the B tile (pairs of elements of one token, not pairs of tokens);
//    see its section below.
//  - block (larger groups): the softmax vertical (a zmm per token, the R heads in lanes), rows of P
//    put together by one 16 x 16 transpose; V's token pairs interleaved as the tiles read them, in
//    the pair order of decode_block_pairs (unpermute_pairs puts the output back);
//    O (R x 16 of D) += P_hi . V pairs + P_lo . V pairs, O kept in the item's accumulator.
// Per KV head and block, the per-head kernel's vector work is a few dozen operations a head, the
// vertical one's a fixed ~600 (16 exps, the transpose, V's re-layout). The per-head kernel stops at 8
// heads: its P tile holds the hi and the lo rows of every head, 2R <= 16 (groups of 9 and more were
// not timed on a per-head kernel).
// The same contract as decode_block_pairs: scores are float32 sums of exact bf16 x bf16 products,
// weights within 2^-17 of float32, accumulation in float32.
//
// The tiles are configured per item; ATen's brgemm (which caches its own configuration per thread)
// is released first, so that its next call configures again.

#pragma once

// (Its includer, paged_attention_avx512.h, includes amx_tiles.h outside its namespace: this file is
// included inside it.)
namespace decode_tiles {

// Query heads per KV head from which the tiles pay: at 1 and 2 decode_block_pairs was 1.1-1.6x faster;
// at 4-8 the per-head tile kernel was 1.1-1.9x faster, at the default model's 3 faster from cache and
// level with it from memory (docs/benchmarks.md, "Decode attention per head on AMX tiles").
constexpr int64_t kMinGroup = 3;

inline bool enabled() {  // PAGEDSERVE_CPU_DECODE_TILES=0 keeps the AVX-512 kernel
  static const bool on = amx_tiles::env_on("PAGEDSERVE_CPU_DECODE_TILES");
  return on;
}

inline bool available() { return enabled() && brgemm_linear::available() && amx_tiles::permitted(); }

// Whether a single-position decode of KV heads with `group` query heads and blocks of `block_size`
// tokens runs here (a head's queries are at most one tile's 16 rows).
inline bool takes(int64_t group, int64_t block_size) {
  return group >= kMinGroup && group <= 16 && block_size == kMaxBlockSize && available();
}

// Tiles: 0 S^T (16 tokens x R), 1 K (16 tokens x 32 of D), 2 Q^T pairs (16 pairs x R), 3 O (R x 16 of
// D), 4 P hi (R x 16 tokens), 5 P lo, 6 V pairs (8 token pairs x 16 of D).
inline void configure(int64_t rows) {
  amx_tiles::Config cfg;
  cfg.tile(0, 16, rows * 4).tile(1, 16, 64).tile(2, 16, rows * 4).tile(3, rows, 64);
  cfg.tile(4, rows, 32).tile(5, rows, 32).tile(6, 8, 64);
  amx_tiles::configure(cfg);
}

// Q^T pairs of one KV head's R query rows q (R, D) bf16: out (D / 32, 16, 16) words, word [j][i][r] =
// the pair (q[r][32 j + 2 i], q[r][32 j + 2 i + 1]); lanes r >= R zero.
template <int64_t D>
inline void pack_queries(const c10::BFloat16* q, int64_t rows, uint32_t* out) {
  std::fill(out, out + D / 32 * 256, 0u);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < D / 2; ++i) std::memcpy(out + i * 16 + r, q + r * D + 2 * i, 4);
}

// One block (n <= 16 tokens, all visible) of one KV head: k, v its rows (`stride` elements apart);
// qt its pack_queries; m, l (16,) the rows' running max and sum (lanes >= R unused); acc (R, D) in
// the pair order; vp scratch (D / 16, 8, 16) words.
template <int64_t D>
inline void block(const c10::BFloat16* k, const c10::BFloat16* v, int64_t stride, int64_t n, int64_t rows,
                  float scale, const uint32_t* qt, float* m, float* l, float* acc, uint32_t* vp) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __mmask16 row_mask = static_cast<__mmask16>((1u << rows) - 1);
  _tile_zero(0);
  for (int64_t j = 0; j < D / 32; ++j) {
    _tile_loadd(1, k + 32 * j, stride * 2);
    _tile_loadd(2, qt + j * 256, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  // V's token pairs while the scores finish: pair p's 32 bf16 of D chunk j, two tokens interleaved
  // within 128-bit lanes (unpacklo: elements 8L..8L+3 of lane L, unpackhi: 8L+4..8L+7); tokens past n
  // are zeros (their rows may hold anything, NaN included).
  for (int64_t p = 0; p < 8; ++p) {
    for (int64_t j = 0; j < D / 32; ++j) {
      const __m512i a = 2 * p < n ? _mm512_loadu_si512(v + 2 * p * stride + 32 * j) : _mm512_setzero_si512();
      const __m512i b = 2 * p + 1 < n ? _mm512_loadu_si512(v + (2 * p + 1) * stride + 32 * j) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (2 * j) * 128 + p * 16, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vp + (2 * j + 1) * 128 + p * 16, _mm512_unpackhi_epi16(a, b));
    }
  }
  alignas(64) float st[16 * 16];
  _tile_stored(0, st, 64);
  // Online softmax, the rows in lanes: a zmm per token.
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 s[16];
  __m512 block_max = _mm512_set1_ps(neg_inf);
  for (int64_t t = 0; t < n; ++t) {
    s[t] = _mm512_mul_ps(_mm512_maskz_loadu_ps(row_mask, st + 16 * t), vscale);
    block_max = _mm512_max_ps(block_max, s[t]);
  }
  const __m512 old_max = _mm512_loadu_ps(m);
  const __m512 new_max = _mm512_max_ps(old_max, block_max);
  const __m512 corr = exp512(_mm512_sub_ps(old_max, new_max));
  __m512 sum = _mm512_setzero_ps();
  __m512i w[16];
  for (int64_t t = 0; t < 16; ++t) {
    if (t >= n) {
      w[t] = _mm512_setzero_si512();
      continue;
    }
    const __m512 e = exp512(_mm512_sub_ps(s[t], new_max));
    sum = _mm512_add_ps(sum, e);
    const __m256bh hi = _mm512_cvtneps_pbh(e);  // e = hi + lo, each a bf16
    const __m512i hi32 = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hi));
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_castsi512_ps(_mm512_slli_epi32(hi32, 16))));
    w[t] = _mm512_or_si512(hi32, _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(lo)), 16));
  }
  _mm512_storeu_ps(m, new_max);
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), corr, sum));
  // The rows' outputs so far, rescaled where their max moved (rarely, once a few blocks are in).
  const __mmask16 moved = _mm512_mask_cmp_ps_mask(row_mask, corr, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ);
  if (moved) {
    alignas(64) float c[16];
    _mm512_store_ps(c, corr);
    for (int64_t r = 0; r < rows; ++r) {
      if (!((moved >> r) & 1)) continue;
      const __m512 cr = _mm512_set1_ps(c[r]);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), cr));
    }
  }
  // P's rows: word (hi | lo << 16) per token, transposed to a row per head, then split into the 16 hi
  // and the 16 lo bf16 of that row.
  quant_linear::transpose16(w);
  const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                         30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  alignas(64) uint16_t pw[16 * 32];
  for (int64_t r = 0; r < rows; ++r) _mm512_store_si512(pw + r * 32, _mm512_permutexvar_epi16(split, w[r]));
  // GCC's tile loads are asm with no memory operand: the stores above (pw, vp, the rescaled acc) must
  // not move past them.
  asm volatile("" : : : "memory");
  _tile_loadd(4, pw, 64);
  _tile_loadd(5, pw + 16, 64);
  for (int64_t c = 0; c < D / 16; ++c) {
    _tile_loadd(3, acc + 16 * c, D * 4);
    _tile_loadd(6, vp + c * 128, 64);
    _tile_dpbf16ps(3, 4, 6);
    _tile_dpbf16ps(3, 5, 6);
    _tile_stored(3, acc + 16 * c, D * 4);
  }
}

// ---- Groups of up to kMaxPerHeadGroup: the softmax per head, tokens in lanes (block_per_head) ----
//
// Where a group has few heads, the vertical softmax of `block` pays for 16 lanes per token with R of
// them used, and V's pairs are re-laid out every block. Here, per block and KV head:
//   S^T (16 tokens x R) = K . Q^T pairs on the tiles as in `block`, stored packed (token t, head r at t R + r);
//   each head's 16 scores gathered into one zmm by two-register permutes (`HeadLanes`), its online
//   softmax horizontal, as decode_block_pairs does;
//   P V with V read in place as the B tile: a B row is a token's 32 elements of D, so the dot product
//   pairs two elements of one token, not two tokens. An A row of words (p_t, 0) then yields the even
//   elements, (0, p_t) the odd ones. Each weight enters as p = hi + lo (the same contract): the hi rows
//   and the lo rows are the two halves of one A tile (2R rows), summed when the item ends.
// Tiles: 0 S^T (16 x R words), 1 and 7 K or V (16 tokens x 32 of D), 2 Q^T pairs (16 pairs x R words),
// 3 P even and 4 P odd (2R x 16 words), 5 and 6 O (2R x 16 floats: the even or odd elements of 32).
constexpr int64_t kMaxPerHeadGroup = 8;

inline void configure_per_head(int64_t rows) {
  amx_tiles::Config cfg;
  cfg.tile(0, 16, rows * 4).tile(1, 16, 64).tile(2, 16, rows * 4).tile(3, 2 * rows, 64).tile(4, 2 * rows, 64);
  cfg.tile(5, 2 * rows, 64).tile(6, 2 * rows, 64).tile(7, 16, 64);
  amx_tiles::configure(cfg);
}

// Head r's 16 scores from S^T stored packed (st[t R + r], 16 R floats in R zmm, R <= 8): from each
// pair of zmm (32 floats) the lanes whose t R + r falls in it.
struct HeadLanes {
  __m512i index[kMaxPerHeadGroup][kMaxPerHeadGroup / 2];
  __mmask16 take[kMaxPerHeadGroup][kMaxPerHeadGroup / 2];
  int64_t pairs = 0;

  explicit HeadLanes(int64_t rows) : pairs((rows + 1) / 2) {
    const __m512i t_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(rows)));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t p = 0; p < pairs; ++p) {
        index[r][p] = _mm512_add_epi32(t_rows, _mm512_set1_epi32(static_cast<int>(r - 32 * p)));
        take[r][p] = _mm512_cmplt_epu32_mask(index[r][p], _mm512_set1_epi32(32));
      }
    }
  }

  __m512 head(const __m512* z, int64_t r) const {
    __m512 s = _mm512_permutex2var_ps(z[0], index[r][0], z[1]);
    for (int64_t p = 1; p < pairs; ++p)
      s = _mm512_mask_mov_ps(s, take[r][p], _mm512_permutex2var_ps(z[2 * p], index[r][p], z[2 * p + 1]));
    return s;
  }
};

// One block (n <= 16 tokens, all visible) of one KV head: k, v its rows (`stride` elements apart);
// qt its pack_queries; m (R,) and l (R, 16) the rows' running max and sum; o (2R, D) the head's hi
// and lo accumulators, each 32 of D as 16 even then 16 odd elements; pw (2, 2R, 16) words and vs
// (16, D) scratch.
template <int64_t D>
inline void block_per_head(const c10::BFloat16* k, const c10::BFloat16* v, int64_t stride, int64_t n, int64_t rows,
                           float scale, const uint32_t* qt, const HeadLanes& lanes, float* m, float* l, float* o,
                           uint32_t* pw, c10::BFloat16* vs) {
  _tile_zero(0);
  for (int64_t j = 0; j < D / 32; ++j) {
    _tile_loadd(1, k + 32 * j, stride * 2);
    _tile_loadd(2, qt + j * 256, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  alignas(64) float st[16 * kMaxPerHeadGroup];
  _tile_stored(0, st, rows * 4);
  // A last block's rows past n may hold anything (NaN included): V's go through zeroed scratch.
  if (n < 16) {
    std::fill(vs, vs + 16 * D, c10::BFloat16(0.0f));
    for (int64_t t = 0; t < n; ++t) std::copy(v + t * stride, v + t * stride + D, vs + t * D);
    v = vs;
    stride = D;
  }
  asm volatile("" : : : "memory");  // GCC's tile stores are asm with no memory operand: st is read below
  __m512 z[kMaxPerHeadGroup];
  for (int64_t j = 0; j < 2 * lanes.pairs; ++j) z[j] = j < rows ? _mm512_load_ps(st + 16 * j) : _mm512_setzero_ps();
  const __mmask16 valid = quant_linear::first_lanes(n);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 s = _mm512_mul_ps(lanes.head(z, r), vscale);
    s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s);
    const __m512 old_max = _mm512_set1_ps(m[r]);
    const __m512 new_max = _mm512_max_ps(old_max, _mm512_set1_ps(_mm512_reduce_max_ps(s)));
    const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, new_max)));
    const __m256bh hi = _mm512_cvtneps_pbh(e);  // e = hi + lo, each a bf16
    const __m512i hi32 = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hi));
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_castsi512_ps(_mm512_slli_epi32(hi32, 16))));
    const __m512i lo32 = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(lo));
    _mm512_store_si512(pw + r * 16, hi32);  // (p, 0): the even elements
    _mm512_store_si512(pw + (rows + r) * 16, lo32);
    _mm512_store_si512(pw + (2 * rows + r) * 16, _mm512_slli_epi32(hi32, 16));  // (0, p): the odd ones
    _mm512_store_si512(pw + (3 * rows + r) * 16, _mm512_slli_epi32(lo32, 16));
    const float max_now = _mm512_cvtss_f32(new_max);
    if (max_now == m[r]) {  // the running max rarely moves once a few blocks are in
      _mm512_storeu_ps(l + r * 16, _mm512_add_ps(_mm512_loadu_ps(l + r * 16), e));
    } else {
      const __m512 c = exp512(_mm512_sub_ps(old_max, new_max));
      _mm512_storeu_ps(l + r * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + r * 16), c, e));
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), c));
        _mm512_storeu_ps(o + (rows + r) * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + (rows + r) * D + d), c));
      }
    }
    m[r] = max_now;
  }
  asm volatile("" : : : "memory");  // ... nor tile loads: pw and o are stored above
  _tile_loadd(3, pw, 64);
  _tile_loadd(4, pw + 2 * rows * 16, 64);
  // O's even and odd halves of 32 elements of D (tiles 5, 6) += P even and odd (tiles 3, 4) . V's 16
  // rows of those elements, in place, loaded into tile VT: 1 and 7 by turns. (A macro: GCC's tile
  // intrinsics spell the tile number into the instruction's text.)
#define PAGEDSERVE_VALUES_SLICE(VT, C)      \
  _tile_loadd(VT, v + 32 * (C), stride * 2); \
  _tile_loadd(5, o + 32 * (C), D * 4);       \
  _tile_loadd(6, o + 32 * (C) + 16, D * 4);  \
  _tile_dpbf16ps(5, 3, VT);                  \
  _tile_dpbf16ps(6, 4, VT);                  \
  _tile_stored(5, o + 32 * (C), D * 4);      \
  _tile_stored(6, o + 32 * (C) + 16, D * 4);
  for (int64_t c = 0; c < D / 32; c += 2) {
    PAGEDSERVE_VALUES_SLICE(1, c)
    if (c + 1 < D / 32) {
      PAGEDSERVE_VALUES_SLICE(7, c + 1)
    }
  }
#undef PAGEDSERVE_VALUES_SLICE
  asm volatile("" : : : "memory");
}

// The K/V lines of physical block `physical` (all KV heads), into L1 while a block computes.
inline void prefetch_block(const c10::BFloat16* k_ptr, const c10::BFloat16* v_ptr, int64_t physical,
                           const Shapes& sh) {
  if (physical < 0 || physical >= sh.num_blocks) return;  // the block's own check reports it
  const int64_t block_elems = sh.block_size * sh.token_stride;
  const char* next_k = reinterpret_cast<const char*>(k_ptr + physical * block_elems);
  const char* next_v = reinterpret_cast<const char*>(v_ptr + physical * block_elems);
  for (int64_t b = 0; b < block_elems * 2; b += 64) {
    _mm_prefetch(next_k + b, _MM_HINT_T0);
    _mm_prefetch(next_v + b, _MM_HINT_T0);
  }
}

// Blocks [blk_begin, blk_end) of a single-position decode of `seq_len` tokens (block table `table`):
// per block, the next one's lines prefetched, then per_head(h, K rows, V rows, tokens n) for each KV head.
template <int64_t D, typename PerHead>
inline void walk_blocks(const c10::BFloat16* k_ptr, const c10::BFloat16* v_ptr, const int32_t* table,
                        int64_t blk_begin, int64_t blk_end, int64_t seq_len, const Shapes& sh, PerHead&& per_head) {
  const int64_t block_elems = sh.block_size * sh.token_stride;
  for (int64_t blk = blk_begin; blk < blk_end; ++blk) {
    const int64_t physical = table[blk];
    TORCH_CHECK(physical >= 0 && physical < sh.num_blocks, "block id out of range");
    const int64_t n = std::min(sh.block_size, seq_len - blk * sh.block_size);
    if (blk + 1 < blk_end) prefetch_block(k_ptr, v_ptr, table[blk + 1], sh);
    for (int64_t h = 0; h < sh.num_kv_heads; ++h) {
      const int64_t at = physical * block_elems + h * D;
      per_head(h, k_ptr + at, v_ptr + at, n);
    }
  }
}

// run_blocks (below) for groups of up to kMaxPerHeadGroup.
template <int64_t D>
void run_blocks_per_head(const c10::BFloat16* q, const c10::BFloat16* k_ptr, const c10::BFloat16* v_ptr,
                         const int32_t* table, int64_t blk_begin, int64_t blk_end, int64_t seq_len, const Shapes& sh,
                         float* m, float* l, float* acc) {
  const int64_t hkv = sh.num_kv_heads, g = sh.group;
  thread_local std::vector<uint32_t> qt;
  thread_local std::vector<float> o;  // per KV head: (2g, D) hi and lo accumulators
  qt.resize(hkv * D / 32 * 256);
  o.assign(hkv * 2 * g * D, 0.0f);
  for (int64_t h = 0; h < hkv; ++h) pack_queries<D>(q + h * g * D, g, qt.data() + h * D / 32 * 256);
  const HeadLanes lanes(g);
  alignas(64) uint32_t pw[4 * kMaxPerHeadGroup * 16];
  alignas(64) c10::BFloat16 vs[16 * D];
  configure_per_head(g);
  const amx_tiles::Release release;
  walk_blocks<D>(k_ptr, v_ptr, table, blk_begin, blk_end, seq_len, sh,
                 [&](int64_t h, const c10::BFloat16* k, const c10::BFloat16* v, int64_t n) {
                   block_per_head<D>(k, v, sh.token_stride, n, g, sh.scale, qt.data() + h * D / 32 * 256, lanes,
                                     m + h * g, l + h * g * 16, o.data() + h * 2 * g * D, pw, vs);
                 });
  // hi + lo, from 16 even then 16 odd elements of each 32 into the pair order of decode_block_pairs
  // (first half: elements 8L + i of 128-bit lane L, i < 4; second half: 8L + 4 + i).
  alignas(64) int32_t first[16], second[16];
  for (int64_t j = 0; j < 16; ++j) {
    const int64_t e1 = 8 * (j / 4) + j % 4, e2 = e1 + 4;
    first[j] = static_cast<int32_t>(e1 % 2 == 0 ? e1 / 2 : 16 + e1 / 2);
    second[j] = static_cast<int32_t>(e2 % 2 == 0 ? e2 / 2 : 16 + e2 / 2);
  }
  const __m512i to_first = _mm512_load_si512(first), to_second = _mm512_load_si512(second);
  for (int64_t h = 0; h < hkv; ++h) {
    const float* oh = o.data() + h * 2 * g * D;
    for (int64_t r = 0; r < g; ++r) {
      for (int64_t c = 0; c < D; c += 32) {
        const __m512 even = _mm512_add_ps(_mm512_loadu_ps(oh + r * D + c), _mm512_loadu_ps(oh + (g + r) * D + c));
        const __m512 odd =
            _mm512_add_ps(_mm512_loadu_ps(oh + r * D + c + 16), _mm512_loadu_ps(oh + (g + r) * D + c + 16));
        float* dst = acc + (h * g + r) * D + c;
        _mm512_storeu_ps(dst, _mm512_permutex2var_ps(even, to_first, odd));
        _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(even, to_second, odd));
      }
    }
  }
}

// Blocks [blk_begin, blk_end) of a single-position decode (its `seq_len` tokens, block table `table`)
// for all KV heads: q (Hq, D) bf16 the queries, ordered by KV head; m (Hq,), l (Hq, 16) and acc
// (Hq, D), as run_decode_item keeps them, are left as decode_block_pairs leaves them (acc in the pair
// order; each row's sum in lane 0 of its l).
template <int64_t D>
void run_blocks(const c10::BFloat16* q, const c10::BFloat16* k_ptr, const c10::BFloat16* v_ptr,
                const int32_t* table, int64_t blk_begin, int64_t blk_end, int64_t seq_len, const Shapes& sh,
                float* m, float* l, float* acc) {
  if (sh.group <= kMaxPerHeadGroup) {
    run_blocks_per_head<D>(q, k_ptr, v_ptr, table, blk_begin, blk_end, seq_len, sh, m, l, acc);
    return;
  }
  const int64_t hkv = sh.num_kv_heads, g = sh.group;
  thread_local std::vector<uint32_t> qt, vp;
  thread_local std::vector<float> state;  // per KV head: running max (16 lanes), then sum (16)
  qt.resize(hkv * D / 32 * 256);
  vp.resize(D / 16 * 128);
  state.assign(hkv * 32, 0.0f);
  for (int64_t h = 0; h < hkv; ++h) {
    pack_queries<D>(q + h * g * D, g, qt.data() + h * D / 32 * 256);
    std::fill(state.begin() + h * 32, state.begin() + h * 32 + 16, -std::numeric_limits<float>::infinity());
  }
  configure(g);
  const amx_tiles::Release release;
  walk_blocks<D>(k_ptr, v_ptr, table, blk_begin, blk_end, seq_len, sh,
                 [&](int64_t h, const c10::BFloat16* k, const c10::BFloat16* v, int64_t n) {
                   block<D>(k, v, sh.token_stride, n, g, sh.scale, qt.data() + h * D / 32 * 256,
                            state.data() + h * 32, state.data() + h * 32 + 16, acc + h * g * D, vp.data());
                 });
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t r = 0; r < g; ++r) {
      m[h * g + r] = state[h * 32 + r];
      l[(h * g + r) * 16] = state[h * 32 + 16 + r];  // the row's other 15 lanes stay 0
    }
  }
}

}  // namespace decode_tiles
