// Prompt attention on AMX tiles (bfloat16, CPUs with AMX-BF16), included by paged_attention_avx512.h
// inside namespace avx512_attention: a flash-attention loop whose two products, S = Q K^T and
// O += P V, are ATen's bf16 brgemm calls (oneDNN's ukernel, csrc/brgemm_linear.h), the online softmax
// between them in float32 AVX-512. `paged_attention` sends it the sequences with at least
// kTilesMinQ new tokens where `brgemm_linear::available()`; shorter ones keep the AVX-512 tile kernel.
//
// The same contract as the AVX-512 kernels: scores are float32 sums of exact bf16 x bf16 products;
// each weight p enters P V as two bf16, p = hi + lo (within 2^-17 of p: see decode_block_pairs), so
// the output is float32-close to the reference, not rounded the way PyTorch's flash kernel rounds P
// to bf16. Per (sequence, KV head) the visible K and V are gathered once from the paged blocks into
// the layouts the tiles read (K^T and V in VNNI pairs, `cpublas::pack`), and every query head of the
// group reads them from there (GQA: one gather per KV head). Work items: (sequence, query head, block
// of kTilesRows query positions), longest first, taken from a shared counter.

#pragma once

// (Its includer, paged_attention_avx512.h, includes brgemm_linear.h, and with it ATen's CPUBlas.h,
// outside its namespace: this file is included inside it.)
namespace prefill_tiles {

constexpr int64_t kTilesMinQ = 64;  // new tokens of a sequence below which the AVX-512 tile kernel is faster
constexpr int64_t kTilesRows = 64;  // query positions an item computes (four 16-row tiles)
constexpr int64_t kKvBlock = 64;    // tokens of K^T a packed block holds: the columns of one S call (four tiles)
constexpr int64_t kStep = 256;      // tokens of K/V one step of the online softmax takes (kKvBlock at a time for S)

inline bool available() { return brgemm_linear::available(); }

// One sequence's visible K and V for one KV head in the tiles' layouts: per kKvBlock tokens, K^T as
// (D / 2, kKvBlock, 2) and V, per kVCols of D, as one run over all tokens (padded / 2, kVCols, 2), so that
// a step's P V is one call; tokens past kv_len are zeros.
struct PackedKv {
  std::vector<c10::BFloat16> kt, v;
  int64_t kv_len = 0, padded = 0;
};

template <int64_t D>
constexpr int64_t kVColsOf = D < 64 ? D : 64;  // V's columns a packed block holds (the packer's widest row)

template <int64_t D>
void pack_kv(PackedKv& out, const c10::BFloat16* k_ptr, const c10::BFloat16* v_ptr, const int32_t* table,
             int64_t kv_len, int64_t kv_head, int64_t block_size, int64_t token_stride, int64_t num_blocks) {
  constexpr int64_t kVCols = kVColsOf<D>;
  const int64_t padded = (kv_len + kKvBlock - 1) / kKvBlock * kKvBlock;
  std::vector<c10::BFloat16> kt_plain(D * padded, c10::BFloat16(0.0f)), v_plain(padded * D, c10::BFloat16(0.0f));
  for (int64_t t = 0; t < kv_len; ++t) {
    const int64_t physical = table[t / block_size];
    TORCH_CHECK(physical >= 0 && physical < num_blocks, "block id out of range");
    const int64_t row = (physical * block_size + t % block_size) * token_stride + kv_head * D;
    for (int64_t d = 0; d < D; ++d) kt_plain[d * padded + t] = k_ptr[row + d];
    std::memcpy(v_plain.data() + t * D, v_ptr + row, D * sizeof(c10::BFloat16));
  }
  out.kt.resize(D * padded);
  out.v.resize(padded * D);
  for (int64_t c0 = 0; c0 < padded; c0 += kKvBlock) {
    at::native::cpublas::pack(D, kKvBlock, padded, kKvBlock, at::kBFloat16, at::kBFloat16, kt_plain.data() + c0,
                              out.kt.data() + c0 * D);
    for (int64_t n0 = 0; n0 < D; n0 += kVCols) {  // the packer writes rows of at most 64 columns
      at::native::cpublas::pack(kKvBlock, kVCols, D, kVCols, at::kBFloat16, at::kBFloat16, v_plain.data() + c0 * D + n0,
                                out.v.data() + n0 * padded + c0 * kVCols);
    }
  }
  out.kv_len = kv_len;
  out.padded = padded;
}

struct TileItem {
  int64_t seq;    // index into the prefill sequences
  int64_t head;   // query head
  int64_t first;  // first query position (of the sequence's new tokens)
  int64_t rows;   // query positions
  int64_t cost;
};

// Rows [first, first + rows) of one query head: q rows `q_stride` apart (the step's (T, Hq, D) query),
// o likewise; `context`: cached tokens before the first new one (row i sees context + first + i + 1).
template <int64_t D>
void run_item(const TileItem& it, const PackedKv& kv, const c10::BFloat16* q, c10::BFloat16* o, int64_t q_stride,
              int64_t context, float scale, float* s, c10::BFloat16* p_hi, c10::BFloat16* p_lo, float* acc, float* m,
              float* l) {
  const int64_t rows = it.rows;
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);
  const int64_t last_visible = context + it.first + rows;  // tokens the last row sees
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t c0 = 0; c0 < last_visible; c0 += kStep) {
    // S for the step's blocks the last row sees (kKvBlock columns a brgemm call), `kStep` apart a row.
    const int64_t width = std::min(kStep, (last_visible - c0 + kKvBlock - 1) / kKvBlock * kKvBlock);
    for (int64_t b0 = 0; b0 < width; b0 += kKvBlock)
      at::native::cpublas::brgemm(rows, kKvBlock, D, q_stride, kKvBlock, kStep, false, q, kv.kt.data() + (c0 + b0) * D,
                                  s + b0, true);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min<int64_t>(width, context + it.first + r + 1 - c0);  // columns this row sees
      float* sr = s + r * kStep;
      __m512 block_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < seen; j += 16) {  // columns past `seen` get no weight (below)
        const __mmask16 valid = seen >= j + 16 ? 0xFFFF : static_cast<__mmask16>((1u << (seen - j)) - 1);
        const __m512 x = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                              _mm512_mul_ps(_mm512_loadu_ps(sr + j), vscale));
        _mm512_storeu_ps(sr + j, x);
        block_max = _mm512_max_ps(block_max, x);
      }
      const float new_max = std::max(m[r], _mm512_reduce_max_ps(block_max));
      const __m512 vmax = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < width; j += 16) {
        __m256i hi_bits = _mm256_setzero_si256(), lo_bits = _mm256_setzero_si256();
        if (j < seen) {
          const __m512 x = _mm512_loadu_ps(sr + j);
          const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
          const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, vmax)));
          sum = _mm512_add_ps(sum, e);
          const __m256bh hi = _mm512_cvtneps_pbh(e);  // e = hi + lo, each a bf16
          const __m512 hi_wide = _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hi)), 16));
          const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, hi_wide));
          hi_bits = reinterpret_cast<const __m256i&>(hi), lo_bits = reinterpret_cast<const __m256i&>(lo);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_hi + r * kStep + j), hi_bits);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_lo + r * kStep + j), lo_bits);
      }
      if (new_max != m[r]) {  // rescale what is summed so far (exp(0) = 1 otherwise)
        const float corr = _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[r] - new_max)));
        const __m512 vc = _mm512_set1_ps(corr);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), vc));
        l[r] *= corr;
        m[r] = new_max;
      }
      l[r] += _mm512_reduce_add_ps(sum);
    }
    // O += P V over the step's tokens, one call per half of P (V's chunks of kVColsOf<D> columns hold
    // their tokens in one run).
    for (int64_t n0 = 0; n0 < D; n0 += kVColsOf<D>) {
      const c10::BFloat16* vb = kv.v.data() + n0 * kv.padded + c0 * kVColsOf<D>;
      at::native::cpublas::brgemm(rows, kVColsOf<D>, width, kStep, kVColsOf<D>, D, true, p_hi, vb, acc + n0, true);
      at::native::cpublas::brgemm(rows, kVColsOf<D>, width, kStep, kVColsOf<D>, D, true, p_lo, vb, acc + n0, true);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t d = 0; d < D; d += 16) store16(o + r * q_stride + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv));
  }
}

// The prompts of a step: seqs (index into ids) with q_len >= kTilesMinQ. q/o (T, Hq, D) bf16.
template <int64_t D>
void run(const std::vector<int64_t>& seqs, c10::BFloat16* o_ptr, const c10::BFloat16* q_ptr,
         const c10::BFloat16* k_ptr, const c10::BFloat16* v_ptr, const int32_t* tables, const int32_t* lens,
         const int32_t* cu, const int64_t* ids, const Shapes& sh) {
  const int64_t num = static_cast<int64_t>(seqs.size()), hkv = sh.num_kv_heads, hq = sh.num_q_heads;
  std::vector<PackedKv> packed(num * hkv);
  at::parallel_for(0, num * hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = ids[seqs[i / hkv]];
      pack_kv<D>(packed[i], k_ptr, v_ptr, tables + b * sh.max_blocks, lens[b], i % hkv, sh.block_size,
                 sh.token_stride, sh.num_blocks);
    }
  });
  std::vector<TileItem> items;
  for (int64_t i = 0; i < num; ++i) {
    const int64_t b = ids[seqs[i]], q_len = cu[b + 1] - cu[b], context = lens[b] - q_len;
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t first = 0; first < q_len; first += kTilesRows) {
        const int64_t rows = std::min(kTilesRows, q_len - first);
        items.push_back({i, h, first, rows, context + first + rows});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const TileItem& a, const TileItem& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    std::vector<float> s(kTilesRows * kStep), acc(kTilesRows * D), m(kTilesRows), l(kTilesRows);
    std::vector<c10::BFloat16> p_hi(kTilesRows * kStep), p_lo(kTilesRows * kStep);
    for (int64_t idx = next.fetch_add(1); idx < num_items; idx = next.fetch_add(1)) {
      const TileItem& it = items[idx];
      const int64_t b = ids[seqs[it.seq]], q_len = cu[b + 1] - cu[b];
      const int64_t offset = ((cu[b] + it.first) * hq + it.head) * D;
      run_item<D>(it, packed[it.seq * hkv + it.head / sh.group], q_ptr + offset, o_ptr + offset, hq * D,
                  lens[b] - q_len, sh.scale, s.data(), p_hi.data(), p_lo.data(), acc.data(), m.data(), l.data());
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace prefill_tiles
