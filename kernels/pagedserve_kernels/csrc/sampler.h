// The sampler's C++ half, reached through the kernels' entry point like every other op (cpu_ops.cpp
// registers it as `pagedserve_cpu::nucleus_draws`; compute_service/engine/sampler.py calls it through
// pagedserve_kernels.cpu_ops.load()). Kept apart from the model's ops (attention, norms, rotary, the
// decoder stack): it reads logits, not the pool or the weights, and only the sampler calls it.
// Builds without AVX-512 have no nucleus_draws (`has_nucleus_draws` says so): the sampler then runs
// its torch version, the same steps.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "exp_approx.h"
#ifdef __AVX512F__
#include <immintrin.h>

#include "paged_attention_avx512.h"  // avx512_attention::exp512
#endif

namespace {
namespace sampler {

#ifdef __AVX512F__
// Deltas below a row's top counted per pass (`count_within`), the candidate count past which
// `nucleus_draws` counts finer deltas, and the widest delta.
constexpr int kDeltas = 8;
constexpr int64_t kRefineAbove = 1024;
// The widest delta tried, as a power of two: 2^100 (> 1e30), where the doubling always stopped.
constexpr int kWidest = 100;

// counts[d] = how many of x's `vocab` values are >= top - deltas[d], the kDeltas of them in one pass.
inline void count_within(const float* x, int64_t vocab, float top, const float deltas[kDeltas],
                         int64_t counts[kDeltas]) {
  __m512 floors[kDeltas];
  __m512i sums[kDeltas];
  for (int d = 0; d < kDeltas; ++d) {
    floors[d] = _mm512_set1_ps(top - deltas[d]);
    sums[d] = _mm512_setzero_si512();
  }
  const __m512i one = _mm512_set1_epi32(1);
  int64_t j = 0;
  for (; j + 16 <= vocab; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    for (int d = 0; d < kDeltas; ++d)
      sums[d] = _mm512_mask_add_epi32(sums[d], _mm512_cmp_ps_mask(v, floors[d], _CMP_GE_OQ), sums[d], one);
  }
  for (int d = 0; d < kDeltas; ++d) {
    counts[d] = _mm512_reduce_add_epi32(sums[d]);
    for (int64_t t = j; t < vocab; ++t) counts[d] += x[t] >= top - deltas[d];
  }
}

// compute_service/engine/sampler.py's `_nucleus_draws` for rows (F, V) float32 at once, in one call
// instead of ~25 tensor ops (each a pass or a dispatch, on caches a decode step's weights have just
// evicted). Per row, as there: the K largest logits in (value descending, token id ascending) order;
// the softmax's denominator z = sum of float32 exp((x - top) * inv_t) over the row, in float64; the
// candidates' float64 probabilities, their running sum, the nucleus (exclusive sums <= top_p), and the
// inverse-CDF draw of u * (the nucleus's mass). A row the candidates cannot decide (the nucleus may
// reach past them, or its edge ties with the K-th value, or no finite distribution) gets -1.
// Differences from the torch version: exp is the Cephes polynomial (relative error ~1e-7, like the
// SLEEF exp torch vectorises; a probability may differ in its 7th digit) and the sums run in another
// order; which of several tokens tied at the K-th value are candidates may differ, which no decided
// row can see (its nucleus ends before that value).
at::Tensor nucleus_draws(const at::Tensor& rows, const at::Tensor& inv_t, const at::Tensor& top_p,
                         const at::Tensor& uniform, int64_t k) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be (F, V) contiguous float32");
  const int64_t num_rows = rows.size(0), vocab = rows.size(1);
  TORCH_CHECK(inv_t.scalar_type() == at::kFloat && top_p.scalar_type() == at::kDouble &&
                  uniform.scalar_type() == at::kDouble && inv_t.numel() == num_rows && top_p.numel() == num_rows &&
                  uniform.numel() == num_rows && inv_t.is_contiguous() && top_p.is_contiguous() &&
                  uniform.is_contiguous(), "inv_t (F,) float32, top_p and uniform (F,) float64");
  k = std::min(k, vocab);
  TORCH_CHECK(k >= 1, "k must be positive");
  at::Tensor out = at::empty({num_rows}, rows.options().dtype(at::kLong));
  const float* xp = rows.data_ptr<float>();
  const float* tp = inv_t.data_ptr<float>();
  const double* pp = top_p.data_ptr<double>();
  const double* up = uniform.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int32_t>> cand;
    std::vector<double> cdf(k);
    for (int64_t f = begin; f < end; ++f) {
      const float* x = xp + f * vocab;
      op[f] = -1;
      // The row's largest value (a NaN anywhere: no decision, as torch's NaN z gives none).
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __mmask16 nan = 0;
      int64_t i = 0;
      for (; i + 16 <= vocab; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
      }
      float top = _mm512_reduce_max_ps(mx);
      bool has_nan = nan != 0;
      for (; i < vocab; ++i) {
        has_nan |= std::isnan(x[i]);
        top = std::max(top, x[i]);
      }
      if (has_nan || !std::isfinite(top)) continue;
      // Candidates: every value within delta of the top, for the smallest of the deltas 1, 2, 4, ...,
      // 2^kWidest that holds at least k (the k-th largest is among them; counting beats sorting
      // thousands of pairs), eight of them counted a pass; none does: all values. Where the one found
      // holds many more than k (a model's logits crowd below a few leaders: 10 within 8 of the top,
      // 2,000 within 16), a second pass counts eight between it and the one before, so the sort below
      // takes a few hundred, not tens of thousands.
      float delta = 0.0f, below = 0.0f;
      int64_t count = 0;
      for (int first = 0; first <= kWidest && count < k; first += kDeltas) {
        float deltas[kDeltas];
        int64_t counts[kDeltas];
        for (int d = 0; d < kDeltas; ++d) deltas[d] = std::ldexp(1.0f, std::min(first + d, kWidest));
        count_within(x, vocab, top, deltas, counts);
        for (int d = 0; d < kDeltas; ++d) {
          below = delta;
          delta = deltas[d], count = counts[d];
          if (count >= k) break;
        }
      }
      if (count >= k && count > kRefineAbove) {
        const float step = (delta - below) / (kDeltas + 1);
        float finer[kDeltas];
        int64_t counts[kDeltas];
        for (int e = 0; e < kDeltas; ++e) finer[e] = below + step * static_cast<float>(e + 1);
        count_within(x, vocab, top, finer, counts);
        for (int e = 0; e < kDeltas; ++e) {
          if (counts[e] >= k) {  // else the coarse delta stays
            delta = finer[e], count = counts[e];
            break;
          }
        }
      }
      const float floor = count >= k ? top - delta : -std::numeric_limits<float>::infinity();
      cand.clear();
      for (int64_t j = 0; j < vocab; ++j)
        if (x[j] >= floor) cand.emplace_back(x[j], static_cast<int32_t>(j));
      if (static_cast<int64_t>(cand.size()) < k) continue;  // fewer finite values than k: the exact path
      const auto before = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before);
      std::sort(cand.begin(), cand.begin() + k, before);
      // z: float32 terms, float64 sum.
      const float it = tp[f];
      const __m512 top16 = _mm512_set1_ps(top), it16 = _mm512_set1_ps(it);
      __m512d z0 = _mm512_setzero_pd(), z1 = _mm512_setzero_pd();
      i = 0;
      for (; i + 16 <= vocab; i += 16) {
        const __m512 e = avx512_attention::exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), top16), it16));
        z0 = _mm512_add_pd(z0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        z1 = _mm512_add_pd(z1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
      }
      double z = _mm512_reduce_add_pd(_mm512_add_pd(z0, z1));
      for (; i < vocab; ++i) z += static_cast<double>(exp_approx((x[i] - top) * it));
      if (!(std::isfinite(z) && z > 0.0)) continue;
      // The candidates' probabilities, their running sums, the nucleus.
      const double it64 = static_cast<double>(it), top64 = static_cast<double>(top);
      double sum = 0.0;
      int64_t num_kept = 0;
      for (int64_t c = 0; c < k; ++c) {
        const double prob = std::exp((static_cast<double>(cand[c].first) - top64) * it64) / z;
        sum += prob;
        cdf[c] = sum;
        num_kept += cdf[c] - prob <= pp[f];  // the exclusive sum, computed as the torch version does
      }
      const int64_t last = std::max<int64_t>(num_kept - 1, 0);
      if (num_kept == 0 || num_kept >= k || cand[last].first == cand[k - 1].first) continue;
      const double u = up[f] * cdf[last];
      int64_t pick = 0;
      for (int64_t c = 0; c < k; ++c) pick += cdf[c] < u;
      op[f] = cand[std::min(pick, last)].second;
    }
  });
  return out;
}
#endif

bool has_nucleus_draws() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

}  // namespace sampler
}  // namespace
