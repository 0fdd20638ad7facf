// Fused CPU kernels of the engine's hot path, registered as torch ops `pagedserve_cpu::*` so that
// they show up by name in torch.profiler. Every op takes float32 or bfloat16 tensors (all of one op's
// tensors the same dtype) and computes in float32: bfloat16 values are widened on load and rounded
// to nearest-even once, on store (norm statistics, rotary, softmax and the attention accumulators
// are float32 throughout).
//
// paged_attention reads K/V blocks in place through the block table: no gathered copy of the
// context, no padding to the longest sequence. One work item is (sequence, KV head, tile of query
// rows); all G query heads that share a KV head are rows of the same item, so each K/V block row
// is read once per group. Softmax is online (running max and sum per row), block by block, like
// FlashAttention. rms_norm, silu_mul and rotary fuse what PyTorch runs as 3-6 separate ops.
//
// Inner loops run over a contiguous last dimension so that the compiler vectorises them (-O3
// -march=native; `omp simd` lets it reorder the reductions); exp is a Cephes-style polynomial
// (exp_approx.h: relative error ~1e-7, like the SLEEF exp of PyTorch's vectorised kernels) so it
// vectorises too. The sampler's op (nucleus_draws) is sampler.h's: only its registration is here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "exp_approx.h"
#include "brgemm_linear.h"
#include "quant_linear.h"
#ifdef __AVX512F__
#include "paged_attention_avx512.h"
#endif
#ifdef __AVX512BF16__
#include "small_linear_bf16.h"
#endif
#include "sampler.h"

namespace {

constexpr int64_t kQueryTile = 16;  // query positions per work item (times G heads = rows)

// Elements an elementwise op gives each thread at least. A parallel region costs a few microseconds
// on an idle machine, and a whole time slice when a thread waits for a core another process holds,
// so decode-sized inputs (tens of rows) run on the calling thread.
constexpr int64_t kMinElementsPerThread = 1 << 15;

inline int64_t rows_per_thread(int64_t row_elements) {
  return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(row_elements, 1));
}

using BF16 = c10::BFloat16;

// A CPU tensor of `dtype`, the dtype of the op's first tensor (float32 or bfloat16).
void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) && t.scalar_type() == dtype,
              name, " must be a CPU tensor of the op's dtype, float32 or bfloat16 (got ", t.scalar_type(), ", want ",
              dtype, ")");
}

// Runs fn(T{}) with T = float or c10::BFloat16, the scalar type of `t`.
template <typename Fn>
decltype(auto) dispatch_float_or_bf16(const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kBFloat16) return fn(BF16{});
  TORCH_CHECK(t.scalar_type() == at::kFloat, "expected a float32 or bfloat16 tensor, got ", t.scalar_type());
  return fn(float{});
}

// out[rows of seq] = attention of query rows over the sequence's paged context.
//   query, out: (T, H_q, D) contiguous; k_cache, v_cache: (num_blocks, block_size, H_kv, D) contiguous.
//   block_tables: (B, max_blocks) int32; seq_lens: (B,) int32 incl. new tokens;
//   cu_seqlens_q: (B + 1,) int32; seq_ids: (N,) int64, the sequences to compute (others untouched).

// One K/V block for every row of a work item: scores, online-softmax update, P @ V.
//   q: (rows, D) pre-scaled; k, v: this head's first token of the block, `token_stride` apart;
//   row r sees min(block_size, first_row_visible + r / group) tokens of the block (causal).
template <int64_t D, typename T>
inline void attend_block(const float* q, const T* k, const T* v, int64_t token_stride, int64_t block_size,
                         int64_t num_rows, int64_t group, int64_t first_row_visible, float* scores, float* row_max,
                         float* row_sum, float* acc) {
  const int64_t n_all = std::min(block_size, first_row_visible + (num_rows - 1) / group);
  for (int64_t t = 0; t < n_all; ++t) {  // K row t once, for every row (reused from L1)
    const T* k_row = k + t * token_stride;
    for (int64_t r = 0; r < num_rows; ++r) {
      const float* q_row = q + r * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q_row[d] * static_cast<float>(k_row[d]);
      scores[r * block_size + t] = dot;
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = std::min(block_size, first_row_visible + r / group);
    float* s = scores + r * block_size;
    float* acc_row = acc + r * D;
    if (n <= 0) {  // this row sees nothing of the block (causal): no weight, nothing to update
      std::fill(s, s + block_size, 0.0f);
      continue;
    }
    float block_max = s[0];
    for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, s[t]);
    const float new_max = std::max(row_max[r], block_max);
    const float correction = exp_approx(row_max[r] - new_max);  // ~0 on the first block (-inf)
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_approx(s[t] - new_max);
      sum += s[t];
    }
    for (int64_t t = n; t < block_size; ++t) s[t] = 0.0f;  // masked: no weight in P @ V below
    row_sum[r] = row_sum[r] * correction + sum;
    row_max[r] = new_max;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc_row[d] *= correction;
  }
  for (int64_t t = 0; t < n_all; ++t) {
    const T* v_row = v + t * token_stride;
    for (int64_t r = 0; r < num_rows; ++r) {
      const float p = scores[r * block_size + t];
      float* acc_row = acc + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc_row[d] += p * static_cast<float>(v_row[d]);
    }
  }
}

// Whether paged_attention runs the AVX-512 kernels for this block size (else the portable one, for
// which PyTorch's SDPA is faster on fresh prompts: the Python side routes those there).
bool uses_avx512_attention(int64_t block_size) {
#ifdef __AVX512F__
  return block_size <= avx512_attention::kMaxBlockSize && block_size % 4 == 0;
#else
  (void)block_size;
  return false;
#endif
}

template <int64_t D, typename T>
void paged_attention_impl(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& seq_ids, double scale, bool portable) {
  (void)portable;  // only the AVX-512 build has another kernel
  const at::ScalarType dtype = query.scalar_type();
  check_dtype(query, "query", dtype);
  check_dtype(out, "out", dtype);
  check_dtype(k_cache, "k_cache", dtype);
  check_dtype(v_cache, "v_cache", dtype);
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "query, out and the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_seqlens_q.scalar_type() == at::kInt && seq_ids.scalar_type() == at::kLong,
              "block_tables, seq_lens, cu_seqlens_q must be int32 and seq_ids int64");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && cu_seqlens_q.is_contiguous() &&
                  seq_ids.is_contiguous(), "index tensors must be contiguous");
  const int64_t num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), num_blocks = k_cache.size(0);
  const int64_t group = num_q_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_q_heads % num_kv_heads == 0, "head shapes do not match");
  const T* q_ptr = query.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int64_t* ids = seq_ids.data_ptr<int64_t>();

  // Work items: (sequence, KV head, query tile), flattened with a prefix sum over sequences.
  const int64_t num_seqs = seq_ids.numel();
  std::vector<int64_t> item_start(num_seqs + 1, 0);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t b = ids[i];
    TORCH_CHECK(b >= 0 && b < seq_lens.numel(), "seq_ids out of range");
    const int64_t q_len = cu[b + 1] - cu[b];
    TORCH_CHECK(q_len >= 1 && lens[b] >= q_len, "sequence ", b, ": bad q_len/seq_len");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= max_blocks, "sequence ", b, ": block table too short");
    item_start[i + 1] = item_start[i] + num_kv_heads * ((q_len + kQueryTile - 1) / kQueryTile);
  }
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of one head
  const float fscale = static_cast<float>(scale);
#ifdef __AVX512F__
  if (!portable && uses_avx512_attention(block_size)) {
    const avx512_attention::Shapes shapes{num_q_heads, num_kv_heads, group, block_size, num_blocks, max_blocks,
                                          token_stride, fscale};
    avx512_attention::paged_attention<D, T>(o_ptr, q_ptr, k_ptr, v_ptr, tables, lens, cu, ids, num_seqs, shapes);
    return;
  }
#endif

  at::parallel_for(0, item_start[num_seqs], 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueryTile * group;
    std::vector<float> q_buf(max_rows * head_dim), acc(max_rows * head_dim), row_max(max_rows), row_sum(max_rows);
    std::vector<float> scores(max_rows * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const int64_t b = ids[i];
      const int64_t local = item - item_start[i];
      const int64_t kv_head = local % num_kv_heads, tile = local / num_kv_heads;
      const int64_t q_len = cu[b + 1] - cu[b], seq_len = lens[b];
      const int64_t first_q = tile * kQueryTile, num_q = std::min(kQueryTile, q_len - first_q);
      const int64_t context = seq_len - q_len;  // absolute position of query 0 of the sequence
      const int64_t num_rows = num_q * group;  // row r: query position first_q + r / group, head r % group
      for (int64_t r = 0; r < num_rows; ++r) {
        const T* src = q_ptr + ((cu[b] + first_q + r / group) * num_q_heads + kv_head * group + r % group) * head_dim;
        float* dst = q_buf.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.begin() + num_rows * head_dim, 0.0f);
      std::fill(row_max.begin(), row_max.begin() + num_rows, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + num_rows, 0.0f);
      const int64_t last_visible = context + first_q + num_q - 1;  // highest position any row sees
      const int32_t* table = tables + b * max_blocks;
      for (int64_t blk = 0; blk * block_size <= last_visible; ++blk) {
        const int64_t physical = table[blk];
        TORCH_CHECK(physical >= 0 && physical < num_blocks, "block id out of range");
        const int64_t base = physical * block_size * token_stride + kv_head * head_dim;
        const int64_t first_row_visible = context + first_q - blk * block_size + 1;  // tokens row 0 sees
        attend_block<D, T>(q_buf.data(), k_ptr + base, v_ptr + base, token_stride, block_size, num_rows, group,
                        first_row_visible, scores.data(), row_max.data(), row_sum.data(), acc.data());
      }
      for (int64_t r = 0; r < num_rows; ++r) {
        T* dst = o_ptr + ((cu[b] + first_q + r / group) * num_q_heads + kv_head * group + r % group) * head_dim;
        const float inv = 1.0f / row_sum[r];
        const float* acc_row = acc.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc_row[d] * inv);
      }
    }
  });
}

void paged_attention_dispatch(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& seq_ids, double scale, bool portable) {
  const auto run = [&](auto head_dim) {  // head_dim as a constant: unrolled rows, accumulators in registers
    dispatch_float_or_bf16(query, [&](auto scalar) {
      paged_attention_impl<decltype(head_dim)::value, decltype(scalar)>(out, query, k_cache, v_cache, block_tables,
                                                                        seq_lens, cu_seqlens_q, seq_ids, scale, portable);
    });
  };
  switch (query.size(-1)) {
    case 16: return run(std::integral_constant<int64_t, 16>());
    case 32: return run(std::integral_constant<int64_t, 32>());
    case 64: return run(std::integral_constant<int64_t, 64>());
    case 128: return run(std::integral_constant<int64_t, 128>());
    default: TORCH_CHECK(false, "paged_attention supports head_dim 16, 32, 64 and 128, got ", query.size(-1));
  }
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& seq_ids, double scale) {
  paged_attention_dispatch(out, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seq_ids, scale, false);
}

// The portable (omp simd) kernel even where the AVX-512 one runs: what x86-64-v3 builds and other
// CPUs run, so that tests and benchmarks on an AVX-512 machine cover and compare both.
void paged_attention_portable(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& seq_ids, double scale) {
  paged_attention_dispatch(out, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seq_ids, scale, true);
}

// x (N, H) -> x / rms(x) * weight; with `residual`, first residual += x and normalise the sum
// (the pre-norm block's "h = x + attn(x); norm(h)" in one pass). The residual stream may be float32
// under bfloat16 weights (the model keeps it so: compute_service/model/model.py): the statistics and
// the product are float32 either way, and the result takes the weight's dtype, rounded once.
template <typename TIn, typename T>
void rms_norm_rows(const TIn* xp, const T* wp, T* op, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, rows_per_thread(hidden), [=](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const TIn* row = xp + i * hidden;
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < hidden; ++j) sq += static_cast<float>(row[j]) * static_cast<float>(row[j]);
      const float inv = 1.0f / std::sqrt(sq / static_cast<float>(hidden) + eps);
      T* o = op + i * hidden;
      for (int64_t j = 0; j < hidden; ++j)
        o[j] = static_cast<T>(static_cast<float>(wp[j]) * (static_cast<float>(row[j]) * inv));
    }
  });
}

// The residual stream's dtype beside the weights': the weights' own, or float32.
void check_residual(const at::Tensor& residual, at::ScalarType weight_dtype) {
  TORCH_CHECK(residual.device().is_cpu() &&
                  (residual.scalar_type() == weight_dtype || residual.scalar_type() == at::kFloat),
              "the residual stream must be a CPU tensor of the weights' dtype or float32 (got ",
              residual.scalar_type(), " under ", weight_dtype, " weights)");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_dtype(weight, "weight", weight.scalar_type());
  check_residual(x, weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "x must be (N, H) contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  dispatch_float_or_bf16(weight, [&](auto scalar) {
    using T = decltype(scalar);
    dispatch_float_or_bf16(x, [&](auto input) {
      using TIn = decltype(input);
      rms_norm_rows<TIn, T>(x.data_ptr<TIn>(), weight.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
    });
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_dtype(x, "x", x.scalar_type());
  check_residual(residual, x.scalar_type());
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && x.is_contiguous(), "shape mismatch");
  const int64_t n = residual.numel();
  dispatch_float_or_bf16(residual, [&](auto scalar) {
    using R = decltype(scalar);
    dispatch_float_or_bf16(x, [&](auto addend) {
      using T = decltype(addend);
      R* rp = residual.data_ptr<R>();
      const T* xp = x.data_ptr<T>();
      at::parallel_for(0, n, kMinElementsPerThread, [=](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) rp[i] = static_cast<R>(static_cast<float>(rp[i]) + static_cast<float>(xp[i]));
      });
    });
  });
  return rms_norm(residual, weight, eps);
}

// gate_up (N, 2I) rows [gate | up] -> (N, I) silu(gate) * up
template <typename T>
void silu_mul_rows(const T* gp, T* op, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, rows_per_thread(inter), [=](int64_t begin, int64_t end) {  // by value: a local bound vectorises
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict__ gate = gp + i * 2 * inter;
      const T* __restrict__ up = gate + inter;
      T* __restrict__ o = op + i * inter;
      int64_t j = 0;
#ifdef __AVX512F__
      // GCC leaves the loop below scalar-speed (~3 cycles an element); 16 lanes at once: ~8x.
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; j + 16 <= inter; j += 16) {
        const __m512 g = avx512_attention::load16(gate + j);
        const __m512 e = avx512_attention::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        avx512_attention::store16(o + j, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)),
                                                       avx512_attention::load16(up + j)));
      }
#endif
      for (; j < inter; ++j) {
        const float g = static_cast<float>(gate[j]);
        o[j] = static_cast<T>(g / (1.0f + exp_approx(-g)) * static_cast<float>(up[j]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_dtype(gate_up, "gate_up", gate_up.scalar_type());
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "gate_up must be (N, 2I)");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  dispatch_float_or_bf16(gate_up, [&](auto scalar) {
    using T = decltype(scalar);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
  });
  return out;
}

// In place on the q and k heads of qkv (T, (H_q + 2 H_kv) D): rotate pairs (x[i], x[i + D/2]) by
// the angles whose cos/sin (T, D) float32 rows are [f | f]: x * cos + rotate_half(x) * sin.
void rotary_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_dtype(qkv, "qkv", qkv.scalar_type());
  check_dtype(cos, "cos", at::kFloat);
  check_dtype(sin, "sin", at::kFloat);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "bad layout");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && qkv.size(1) >= num_heads * head_dim,
              "cos/sin must be (T, D)");
  const int64_t tokens = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  dispatch_float_or_bf16(qkv, [&](auto scalar) {
    using T = decltype(scalar);
    T* xp = qkv.data_ptr<T>();
    at::parallel_for(0, tokens, rows_per_thread(num_heads * head_dim), [=](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + t * head_dim;
        const float* s = sp + t * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
          T* x = xp + t * width + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
            x[i + half] = static_cast<T>(x2 * c[i + half] + x1 * s[i + half]);
          }
        }
      }
    });
  });
}

// The step's new K/V into one layer's caches: row t of key/value goes to pool slot slots[t]
// (slot = block * block_size + offset; negative: not written). key, value: (T, H_kv, D), heads
// contiguous in a row, any row stride (views into the fused QKV); caches: (num_blocks, block_size,
// H_kv, D) contiguous, the dtype of key and value (a copy, no conversion). One memcpy per row and
// cache, rows split between threads: `index_copy_` on the pool view (TensorIterator over a strided
// source) was several times slower (docs/benchmarks.md, "Figures behind the code's choices").
void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& slots) {
  const at::ScalarType dtype = k_cache.scalar_type();
  check_dtype(k_cache, "k_cache", dtype);
  check_dtype(v_cache, "v_cache", dtype);
  check_dtype(key, "key", dtype);
  check_dtype(value, "value", dtype);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes(), "k_cache, v_cache must be (num_blocks, block_size, H_kv, D) contiguous");
  const int64_t heads = k_cache.size(2), dim = k_cache.size(3), row = heads * dim;
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == heads && t->size(2) == dim && t->stride(2) == 1 && t->stride(1) == dim,
                "key, value must be (T, H_kv, D) with contiguous heads");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
              slots.size(0) == key.size(0) && value.size(0) == key.size(0), "slots must be (T,) int64");
  const int64_t tokens = key.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " is past the cache");
  const int64_t elem = k_cache.element_size(), row_bytes = row * elem;
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * elem, v_stride = value.stride(0) * elem;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, tokens, rows_per_thread(2 * row), [=](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + sp[t] * row_bytes, vp + t * v_stride, row_bytes);
    }
  });
}

// The most rows of x `small_linear` takes (0: this build has no such kernel, it needs AVX512-BF16).
// Past them oneDNN's packed matmul is faster (GEMM tiles: docs/benchmarks.md).
int64_t small_linear_rows() {
#ifdef __AVX512BF16__
  return 16;
#else
  return 0;
#endif
}

// x (M, K) @ weight (N, K)^T + bias, bf16, for few rows (csrc/small_linear_bf16.h); the plain weight.
// The output is bf16, or float32 with `float_out` (the LM head: logits rounded to bf16 lose ties of
// ~0.06 at a logit of 10, and near-ties decide greedy answers).
at::Tensor small_linear_impl(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             bool float_out) {
  check_dtype(x, "x", at::kBFloat16);
  check_dtype(weight, "weight", at::kBFloat16);
  // A weight in the tile layout (`brgemm_pack`: (N / kBlockN, K / 2, kBlockN, 2)) or plain (N, K).
  const bool tiles = weight.dim() == 4;
  TORCH_CHECK(tiles ? brgemm_linear::available() : small_linear_rows() > 0,
              "small_linear needs a build with AVX512-BF16, or AMX tiles for a packed weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
                  (tiles ? weight.size(2) == brgemm_linear::kBlockN && weight.size(3) == 2 && x.size(1) == 2 * weight.size(1)
                         : weight.dim() == 2 && x.size(1) == weight.size(1)),
              "small_linear: x (M, K) and weight (N, K), or as brgemm_pack made it, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = tiles ? weight.size(0) * brgemm_linear::kBlockN : weight.size(0);
  const c10::BFloat16* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_dtype(*bias, "bias", at::kBFloat16);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(), "small_linear: bias (N,)");
    bias_ptr = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (tiles) {
    const c10::BFloat16* w = weight.data_ptr<c10::BFloat16>();
    if (float_out) {
      brgemm_linear::linear(x.data_ptr<c10::BFloat16>(), w, bias_ptr, y.data_ptr<float>(), M, K, N);
    } else {
      brgemm_linear::linear(x.data_ptr<c10::BFloat16>(), w, bias_ptr, y.data_ptr<c10::BFloat16>(), M, K, N);
    }
    return y;
  }
#ifdef __AVX512BF16__
  if (float_out) {
    bf16_rows::linear(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), bias_ptr, y.data_ptr<float>(),
                      M, K, N);
  } else {
    bf16_rows::linear(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), bias_ptr,
                      y.data_ptr<c10::BFloat16>(), M, K, N);
  }
#endif
  return y;
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return small_linear_impl(x, weight, bias, false);
}

// The same product with float32 outputs, any number of rows (the weight is read once per call).
at::Tensor small_linear_float(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return small_linear_impl(x, weight, bias, true);
}

// The instructions paged_attention is built with: "avx512-bf16" (bf16 K/V read in place as pairs,
// csrc/paged_attention_avx512.h), "avx512" (bf16 widened to float32 first), "portable" (omp simd).
std::string attention_isa() {
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

// Prompts of at least this many new tokens take the AMX tiles in bf16 (csrc/prefill_tiles.h); 0: none here.
int64_t prompt_tiles_min_tokens() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return avx512_attention::prefill_tiles::available() ? avx512_attention::prefill_tiles::kTilesMinQ : 0;
#else
  return 0;
#endif
}

// Single-position decodes whose KV heads have at least this many query heads take the AMX tiles in bf16
// (csrc/decode_tiles.h; head dims that are multiples of 32, blocks of 16 tokens); 0: none here.
int64_t decode_tiles_min_group() {
#ifdef PAGEDSERVE_AMX_TILES
  return avx512_attention::decode_tiles::available() ? avx512_attention::decode_tiles::kMinGroup : 0;
#else
  return 0;
#endif
}

// Whether the small-batch linear runs on AMX tiles here (csrc/brgemm_linear.h): `brgemm_pack` works.
bool brgemm_linear_available() { return brgemm_linear::available(); }

// weight (N, K) bf16 -> the tile layout `small_linear` also reads (csrc/brgemm_linear.h): N a multiple
// of brgemm_block_n(), K even, and only where brgemm_linear_available().
at::Tensor brgemm_pack(const at::Tensor& weight) {
  TORCH_CHECK(brgemm_linear::available(), "brgemm_pack: no bf16 brgemm on this CPU (brgemm_linear_available)");
  check_dtype(weight, "weight", at::kBFloat16);
  TORCH_CHECK(weight.dim() == 2 && brgemm_linear::packs(weight.size(0), weight.size(1)),
              "brgemm_pack: weight must be (N, K), N a multiple of ", brgemm_linear::kBlockN, ", K even");
  return brgemm_linear::pack(weight.contiguous());
}

int64_t brgemm_block_n() { return brgemm_linear::kBlockN; }

// The weight-only quantized linear (csrc/quant_linear.h): the weight as kernels/pagedserve_kernels/quant.py
// packs it (`bits` 8, 6 or 4, `group` inputs per scale), its first `n` columns; bias float32 (n,). bf16
// activations take the vector kernels (on AMX tiles with `tiles`, where brgemm_linear_available());
// float32 ones, or a build without AVX512-BF16, the widened weight through at::linear.
quant_linear::Weight quant_weight(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                  int64_t bits, int64_t group) {
  using quant_linear::kBlockN, quant_linear::kSuperK;
  TORCH_CHECK(bits == 8 || bits == 6 || bits == 4, "quant_linear: bits must be 8, 6 or 4, got ", bits);
  TORCH_CHECK(group > 0 && group % 2 == 0, "quant_linear: group must be even and positive, got ", group);
  // float16 (blocks, K / group, kBlockN), or compact: bytes (blocks, K / kSuperK, super_bytes)
  const bool compact = scales.scalar_type() == at::kByte;
  TORCH_CHECK(scales.device().is_cpu() && (scales.scalar_type() == at::kHalf || compact),
              "quant_linear: scales must be float16 (or compact uint8) on the CPU");
  TORCH_CHECK(q.device().is_cpu() && (!mins.has_value() || mins->device().is_cpu()),
              "quant_linear: q and mins must be on the CPU");
  TORCH_CHECK(!compact || ((bits == 6 || bits == 4) && kSuperK % group == 0),
              "quant_linear: compact scales are for 6 and 4 bits, with groups that divide 256, got bits ", bits,
              " and group ", group);
  const int64_t row = compact ? 2 * kBlockN + kSuperK / group * kBlockN : kBlockN;
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == row && scales.is_contiguous(),
              "quant_linear: scales must be (blocks, K / ", compact ? "256" : "group", ", ", row, ") contiguous");
  const int64_t blocks = scales.size(0), K = scales.size(1) * (compact ? kSuperK : group);
  TORCH_CHECK(K > 0, "quant_linear: no inputs");
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == (bits == 8 ? at::kChar : at::kByte) &&
                  q.numel() == blocks * K * quant_linear::kBlockN * bits / 8,
              "quant_linear: q must be contiguous int8 (8 bits) or uint8 (6 and 4 bits), ",
              blocks * K * quant_linear::kBlockN * bits / 8,
              " of them for ", blocks, " blocks of ", K, " inputs at ", bits, " bits");
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->sizes() == scales.sizes() && mins->is_contiguous(),
                "quant_linear: mins must match scales (dtype and shape)");
  }
  return quant_linear::Weight::make(static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr(),
                                    mins.has_value() ? mins->data_ptr() : nullptr, bits, group, K, blocks, compact);
}

// (n, K) float32: the weight widened (the fallback's operand and the tests' reference).
at::Tensor quant_dequantize(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            int64_t bits, int64_t group, int64_t n) {
  const quant_linear::Weight w = quant_weight(q, scales, mins, bits, group);
  TORCH_CHECK(n > 0 && n <= w.blocks * quant_linear::kBlockN, "quant_dequantize: n out of range: ", n);
  return quant_linear::dequantize_scalar(w).narrow(0, 0, n).contiguous();
}

at::Tensor quant_linear_op(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
                           int64_t group, int64_t n, bool tiles, bool float_out) {
  const quant_linear::Weight w = quant_weight(q, scales, mins, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K && x.is_contiguous(), "quant_linear: x must be (M, ", w.K,
              ") contiguous, got ", x.sizes());
  TORCH_CHECK(n > 0 && n <= w.blocks * quant_linear::kBlockN, "quant_linear: n out of range: ", n);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_dtype(*bias, "bias", at::kFloat);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "quant_linear: bias must be (", n,
                ",) contiguous, got ", bias->sizes());
    bias_ptr = bias->data_ptr<float>();
  }
  TORCH_CHECK(!tiles || brgemm_linear::available(), "quant_linear: no AMX tiles here (brgemm_linear_available)");
  const at::ScalarType out_type = float_out ? at::kFloat : x.scalar_type();
#ifdef __AVX512BF16__
  if (x.scalar_type() == at::kBFloat16) {
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, n}, x.options().dtype(out_type));
    if (M == 0) return y;
    if (float_out) {
      quant_linear::linear(w, x.data_ptr<c10::BFloat16>(), bias_ptr, y.data_ptr<float>(), M, n, tiles);
    } else {
      quant_linear::linear(w, x.data_ptr<c10::BFloat16>(), bias_ptr, y.data_ptr<c10::BFloat16>(), M, n, tiles);
    }
    return y;
  }
#ifdef __AVX512VNNI__
  if (x.scalar_type() == at::kFloat && quant_linear::float_rows(w)) {
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, n}, x.options());
    if (M > 0) quant_linear::linear_float(w, x.data_ptr<float>(), bias_ptr, y.data_ptr<float>(), M, n);
    return y;
  }
#endif
#endif
  at::Tensor widened = quant_linear::dequantize_scalar(w).narrow(0, 0, n);
  at::Tensor y = at::linear(x.to(at::kFloat), widened, bias.has_value() ? std::optional<at::Tensor>(*bias) : std::nullopt);
  return y.to(out_type);
}

// Rows `ids` of a quantized (N, K) weight, widened to float32 (T, K): an embedding table kept quantized.
at::Tensor quant_rows(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t bits,
                      int64_t group, int64_t n, const at::Tensor& ids) {
  const quant_linear::Weight w = quant_weight(q, scales, mins, bits, group);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quant_rows: ids must be (T,) int64");
  const at::Tensor index = ids.contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  const int64_t T = index.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < n, "quant_rows: id ", id[t], " out of range [0, ", n, ")");
  at::Tensor out = at::empty({T, w.K}, at::kFloat);
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = id[t] / quant_linear::kBlockN, col = id[t] % quant_linear::kBlockN;
      for (int64_t k = 0; k < w.K; ++k) dst[t * w.K + k] = quant_linear::value(w, b, k, col);
    }
  });
  return out;
}

// Which kernel quant_linear runs for bf16 activations in this build: "avx512-bf16" or "widened".
std::string quant_linear_isa() {
#ifdef __AVX512BF16__
  return "avx512-bf16";
#else
  return "widened";
#endif
}

// Up to this many rows (from past the few-row path's), a quantized linear with bf16 activations on a CPU
// without AMX tiles multiplies int8 activations with AVX512-VNNI (csrc/quant_linear.h `vnni_block`); 0:
// not now (no such path here, or the loaded model keeps bf16 activations: quant_set_int8_activations).
int64_t quant_vnni_rows() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return quant_linear::int8_here() ? quant_linear::kVnniRows : 0;
#else
  return 0;
#endif
}

// From this many rows on, a quantized linear with bf16 activations on a CPU without AMX tiles multiplies
// int8 activations in tiles of rows over whole column blocks (csrc/quant_linear.h `vnni_tiles`); 0: not
// now (as quant_vnni_rows).
int64_t quant_vnni_tile_rows() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return quant_linear::int8_here() ? quant_linear::kVnniRows + 1 : 0;
#else
  return 0;
#endif
}

// Whether a quantized linear with float32 activations runs on the VNNI kernels here (x split into two
// int8 parts: csrc/quant_linear.h `linear_float`); false: its weight is widened to float32 at each call.
bool quant_float_vnni() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return quant_linear::vnni_enabled();
#else
  return false;
#endif
}

// Hand back the calling thread's scratch of the VNNI tiles (a prompt's int8 activations, tens of MB):
// the engine calls it when idle, before returning free memory to the system.
void quant_release_scratch() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  quant_linear::release_prompt_rows();
#endif
}

// Turn the int8 activations of the VNNI paths on or off for this process (a model's choice, made at
// load); returns whether they run now: false where this CPU or build has no such path (AMX tiles, no
// AVX512-VNNI, PAGEDSERVE_CPU_QUANT_VNNI=0), whatever `on` asked.
bool quant_set_int8_activations(bool on) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  quant_linear::int8_activations().store(on);
  return quant_linear::int8_here();
#else
  (void)on;
  return false;
#endif
}

// From this many rows on, a quantized linear with bf16 outputs runs on oneDNN's matmul over widened
// blocks (csrc/quant_linear.h `linear_onednn`); 0: not now (no AVX512-BF16 in this build, or the VNNI
// tiles take those rows: all but a weight whose groups are not whole 16-input vectors).
int64_t quant_onednn_rows() {
#ifdef __AVX512BF16__
  return quant_vnni_tile_rows() ? 0 : quant_linear::kOnednnRows;
#else
  return 0;
#endif
}

// x (M, in) @ packed.T + bias on oneDNN's matmul (`packed`: the opaque mkldnn tensor of `prepack`).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  // Boxed: the kernel's C++ signature is torch's internal business; the schema is the contract.
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

// oneDNN's matmul sometimes leaves the second thread idle on a prompt's rows: the default model's o and
// down projections (576 outputs) took as long on two threads as on one at 300-1,000 rows, while its
// 960- and 3,072-wide ones ran twice as fast, and there splitting the rows between the threads (each
// running oneDNN alone) lost (docs/benchmarks.md, "Prompt linears split by rows"). Which shapes gain is
// oneDNN's business and this CPU's, so it is measured: `packed_linear_calibrate` times both ways at
// kCalibrationRows rows when a weight is packed, and from kSplitMinRows rows `packed_linear` splits the
// shapes (outputs, inputs) where splitting won by kSplitMargin. Fixed once measured: a shape's products
// do not change mid-run.
constexpr int64_t kSplitMinRows = 256, kCalibrationRows = 512, kCalibrationTrials = 3;
constexpr double kSplitMargin = 0.9;

// (outputs, inputs, dtype, threads) -> split the rows; `packed_linear_calibrate` fills it.
using SplitKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;
std::mutex split_mutex;
std::map<SplitKey, bool> split_shapes;

SplitKey split_key(const at::Tensor& packed) {
  return {packed.size(0), packed.size(1), static_cast<int64_t>(packed.scalar_type()), at::get_num_threads()};
}

bool splits_rows(const at::Tensor& packed) {
  std::lock_guard<std::mutex> lock(split_mutex);
  const auto it = split_shapes.find(split_key(packed));
  return it != split_shapes.end() && it->second;
}

// x's rows in one oneDNN call per thread (multiples of 32, oneDNN's row block), outputs concatenated.
at::Tensor split_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), threads = at::get_num_threads();
  const int64_t share = (M + threads - 1) / threads;
  const int64_t chunk = (share + 31) / 32 * 32, parts = (M + chunk - 1) / chunk;
  std::vector<at::Tensor> outputs(parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      outputs[i] = onednn_linear(x.narrow(0, i * chunk, std::min(chunk, M - i * chunk)), packed, bias);
    }
  });
  return at::cat(outputs);
}

// x (M, in) @ packed.T + bias on oneDNN: the op cpu_linear.py's `linear` and `any_linear` both run for a
// packed weight; a prompt's rows split between the threads where `packed_linear_calibrate` found it faster.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  if (x.size(0) >= kSplitMinRows && at::get_num_threads() > 1 && !at::in_parallel_region() && x.is_contiguous() &&
      splits_rows(packed)) {
    return split_linear(x, packed, bias);
  }
  return onednn_linear(x, packed, bias);
}

// Measures, once per shape and dtype at this thread count, whether splitting a prompt's rows beats
// oneDNN's own threading here (best of kCalibrationTrials each way at kCalibrationRows rows of constant
// input, oneDNN's own way timed before and after) and returns the choice `packed_linear` keeps. `force` 0
// or 1 sets it instead (tests, PAGEDSERVE_CPU_SPLIT_ROWS). One thread: never split.
bool packed_linear_calibrate(const at::Tensor& packed, int64_t force) {
  const SplitKey key = split_key(packed);
  if (force == 0 || force == 1) {
    std::lock_guard<std::mutex> lock(split_mutex);
    return split_shapes[key] = force == 1;
  }
  {
    std::lock_guard<std::mutex> lock(split_mutex);
    const auto it = split_shapes.find(key);
    if (it != split_shapes.end()) return it->second;
  }
  bool split = false;
  if (at::get_num_threads() > 1) {
    const at::Tensor x = at::full({kCalibrationRows, packed.size(1)}, 0.5, at::TensorOptions().dtype(packed.scalar_type()));
    auto fastest = [&](bool rows) {
      double best = std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t <= kCalibrationTrials; ++t) {  // the first a warm-up
        const auto start = std::chrono::steady_clock::now();
        rows ? split_linear(x, packed, std::nullopt) : onednn_linear(x, packed, std::nullopt);
        const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (t > 0) best = std::min(best, took);
      }
      return best;
    };
    const double whole = fastest(false), rows = fastest(true);
    split = rows < kSplitMargin * std::min(whole, fastest(false));
  }
  std::lock_guard<std::mutex> lock(split_mutex);
  return split_shapes.emplace(key, split).first->second;
}

// x (M, in) @ weight.T + bias as kernels/pagedserve_kernels/cpu_linear.py's `linear` computes it: `small_linear` for a few
// bf16 rows on a plain weight (`small_rows`: its limit, 0 = never), else oneDNN on the packed copy
// (`prepack`: an opaque mkldnn tensor) where there is one, else at::linear on the plain weight.
// With `float_out`, the small-batch kernel's outputs are float32 (the others' stay in x's dtype).
at::Tensor any_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                      const std::optional<at::Tensor>& bias, int64_t small_rows, bool float_out) {
  if (x.size(0) <= small_rows && x.scalar_type() == at::kBFloat16 && weight.numel() > 0) {
    return small_linear_impl(x, weight, bias, float_out);
  }
  if (!packed.has_value()) return at::linear(x, weight, bias);
  return packed_linear(x, *packed, bias);
}

// Tensors of one layer in `decoder_layers`' lists (see kernels/pagedserve_kernels/step.py's LayerStack).
constexpr int64_t kLayerWeights = 6;  // input norm, qkv, o, post-attention norm, gate_up, down
constexpr int64_t kLayerProjections = 4;  // packed copies and biases: qkv, o, gate_up, down (each may be None)
constexpr int64_t kQuantParts = 2;  // a quantized projection's parts at most (q/k and v of another type)
constexpr int64_t kQuantMeta = 1 + 3 * kQuantParts;
constexpr int64_t kQuantTensors = 4 * kQuantParts;

// Every decoder layer of one step in one call: per layer, exactly the ops the Python loop runs
// (compute_service/model/layers.py's DecoderLayer.forward with the fused plan of kernels/pagedserve_kernels/cpu_attention.py),
// in the same order and on the same kernels, so the results are the same bits. What it saves is the
// interpreter between them: ~17 Python-level calls a layer (each a few microseconds: argument
// parsing, dispatch, views, profiler checks), ~500 a step, which at one decoding sequence were a
// large share of the step. Each part is a profiler range of the Python path's name (step_profile.py).
//   residual: (T, hidden) the layer input's residual stream, updated in place; pending: (T, hidden)
//   the previous MLP output not yet added (None before the first layer). Returns the last layer's
//   MLP output (the stack's output is residual + it).
at::Tensor decoder_layers(at::Tensor residual, const std::optional<at::Tensor>& pending, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& packed,
                          const c10::List<std::optional<at::Tensor>>& biases, int64_t small_rows, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& kv_pool, const at::Tensor& slots,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                          const at::Tensor& seq_ids, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          double eps, double scale, const c10::List<std::optional<at::Tensor>>& quant,
                          at::IntArrayRef quant_meta, bool quant_tiles) {
  const int64_t num_layers = static_cast<int64_t>(weights.size()) / kLayerWeights;
  // Projections kept quantized (kernels/pagedserve_kernels/quant.py): per projection kQuantMeta ints (parts,
  // then bits, group, outputs of each part) and kQuantTensors tensors (q, scales, mins, bias of each part);
  // both empty for a model without any.
  const bool quantized = !quant_meta.empty();
  TORCH_CHECK(!quantized || (static_cast<int64_t>(quant_meta.size()) == num_layers * kLayerProjections * kQuantMeta &&
                             static_cast<int64_t>(quant.size()) == num_layers * kLayerProjections * kQuantTensors),
              "decoder_layers: ", kQuantMeta, " quant_meta ints and ", kQuantTensors, " quant tensors a projection");
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(weights.size()) == num_layers * kLayerWeights &&
                  static_cast<int64_t>(packed.size()) == num_layers * kLayerProjections &&
                  static_cast<int64_t>(biases.size()) == num_layers * kLayerProjections,
              "decoder_layers: ", kLayerWeights, " weights, ", kLayerProjections, " packed copies and ",
              kLayerProjections, " biases a layer");
  TORCH_CHECK(kv_pool.dim() == 6 && kv_pool.size(0) == num_layers && kv_pool.size(1) == 2 && kv_pool.is_contiguous(),
              "kv_pool must be (num_layers, 2, num_blocks, block_size, H_kv, D) contiguous");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be (T, hidden) contiguous");
  const int64_t tokens = residual.size(0);
  const int64_t q_size = num_q_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor mlp_out = pending.has_value() ? *pending : at::Tensor();
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kLayerWeights;
    // Projection i (0 qkv, 1 o, 2 gate_up, 3 down; its plain weight is w[plain]) of x; float32 outputs
    // where the small-batch kernel runs for qkv, o and down (see DecoderLayer.forward).
    const auto project = [&](const at::Tensor& x, int64_t i, int64_t plain) {
      const int64_t index = layer * kLayerProjections + i;
      const int64_t* meta = quantized ? quant_meta.data() + index * kQuantMeta : nullptr;
      if (meta == nullptr || meta[0] == 0) {
        return any_linear(x, w[plain], packed.get(index), biases.get(index), small_rows, i != 2);
      }
      std::vector<at::Tensor> parts;
      for (int64_t part = 0; part < meta[0]; ++part) {
        const int64_t t = index * kQuantTensors + part * 4;
        const std::optional<at::Tensor> q = quant.get(t), scales = quant.get(t + 1);
        TORCH_CHECK(q.has_value() && scales.has_value(), "decoder_layers: a quantized part without q or scales");
        parts.push_back(quant_linear_op(x, *q, *scales, quant.get(t + 2), quant.get(t + 3), meta[1 + 3 * part],
                                        meta[2 + 3 * part], meta[3 + 3 * part], quant_tiles, i != 2));
      }
      return parts.size() == 1 ? parts[0] : at::cat(parts, 1);
    };
    at::Tensor normed;
    {
      RECORD_FUNCTION("norm", c10::ArrayRef<const c10::IValue>{});
      normed = mlp_out.defined() ? add_rms_norm(residual, mlp_out, w[0], eps) : rms_norm(residual, w[0], eps);
    }
    at::Tensor qkv;
    {
      RECORD_FUNCTION("qkv_proj", c10::ArrayRef<const c10::IValue>{});
      qkv = project(normed, 0, 1);  // (T, q_size + 2 kv_size) rows [q | k | v]
    }
    {
      RECORD_FUNCTION("rotary", c10::ArrayRef<const c10::IValue>{});
      rotary_(qkv, cos, sin, num_q_heads + num_kv_heads, head_dim);
      if (qkv.scalar_type() != normed.scalar_type()) qkv = qkv.to(normed.scalar_type());  // one rounding, after it
    }
    at::Tensor attn;
    {
      RECORD_FUNCTION("attention", c10::ArrayRef<const c10::IValue>{});
      const at::Tensor k_cache = kv_pool[layer][0], v_cache = kv_pool[layer][1];
      const at::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
      const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
      write_kv_(k_cache, v_cache, key, value, slots);
      const at::Tensor query = qkv.narrow(1, 0, q_size).contiguous().view({tokens, num_q_heads, head_dim});
      attn = at::empty_like(query);
      paged_attention_dispatch(attn, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seq_ids, scale,
                               false);
    }
    at::Tensor attn_out;
    {
      RECORD_FUNCTION("o_proj", c10::ArrayRef<const c10::IValue>{});
      attn_out = project(attn.view({tokens, q_size}), 1, 2);
    }
    {
      RECORD_FUNCTION("norm", c10::ArrayRef<const c10::IValue>{});
      normed = add_rms_norm(residual, attn_out, w[3], eps);
    }
    at::Tensor gate_up;
    {
      RECORD_FUNCTION("mlp_gate_up", c10::ArrayRef<const c10::IValue>{});
      gate_up = project(normed, 2, 4);  // (T, 2I) [gate | up]
    }
    at::Tensor act;
    {
      RECORD_FUNCTION("silu_mul", c10::ArrayRef<const c10::IValue>{});
      act = silu_mul(gate_up);
    }
    {
      RECORD_FUNCTION("mlp_down", c10::ArrayRef<const c10::IValue>{});
      mlp_out = project(act, 3, 5);
    }
  }
  return mlp_out;
}

// How many threads at::parallel_for really runs on in this build (one if it was compiled without
// OpenMP, whatever torch.get_num_threads() says): the check that the ops above run in parallel.
int64_t parallel_threads() {
  const int64_t wanted = at::get_num_threads();
  std::vector<std::atomic<int>> seen(wanted);
  at::parallel_for(0, wanted, 1, [&](int64_t, int64_t) { seen[at::get_thread_num() % wanted].store(1); });
  int64_t count = 0;
  for (const auto& flag : seen) count += flag.load();
  return count;
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor cu_seqlens_q, Tensor seq_ids, float scale) -> ()");
  m.def("paged_attention_portable(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, Tensor seq_ids, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slots) -> ()");
  m.def("decoder_layers(Tensor(a!) residual, Tensor? pending, Tensor[] weights, Tensor?[] packed, Tensor?[] biases, "
        "int small_rows, Tensor cos, Tensor sin, Tensor(b!) kv_pool, Tensor slots, Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, "
        "Tensor seq_ids, int num_q_heads, int num_kv_heads, int head_dim, float eps, float scale, Tensor?[] quant, "
        "int[] quant_meta, bool quant_tiles) -> Tensor");
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_linear_float(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_linear_rows() -> int");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("packed_linear_calibrate(Tensor packed, int force=-1) -> bool");
  m.def("brgemm_linear_available() -> bool");
  m.def("brgemm_block_n() -> int");
  m.def("attention_isa() -> str");
  m.def("prompt_tiles_min_tokens() -> int");
  m.def("decode_tiles_min_group() -> int");
  m.def("brgemm_pack(Tensor weight) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, Tensor? mins, Tensor? bias, int bits, int group, int n, "
        "bool tiles, bool float_out) -> Tensor");
  m.def("quant_dequantize(Tensor q, Tensor scales, Tensor? mins, int bits, int group, int n) -> Tensor");
  m.def("quant_linear_isa() -> str");
  m.def("quant_onednn_rows() -> int");
  m.def("quant_vnni_rows() -> int");
  m.def("quant_vnni_tile_rows() -> int");
  m.def("quant_set_int8_activations(bool on) -> bool");
  m.def("quant_release_scratch() -> ()");
  m.def("quant_float_vnni() -> bool");
  m.def("quant_rows(Tensor q, Tensor scales, Tensor? mins, int bits, int group, int n, Tensor ids) -> Tensor");
  m.def("nucleus_draws(Tensor rows, Tensor inv_t, Tensor top_p, Tensor uniform, int k) -> Tensor");
  m.def("has_nucleus_draws() -> bool");
  m.def("parallel_threads() -> int");
  m.def("avx512_attention(int block_size) -> bool");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_portable", &paged_attention_portable);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_", &rotary_);
  m.impl("write_kv_", &write_kv_);
  m.impl("small_linear", &small_linear);
  m.impl("small_linear_float", &small_linear_float);
  m.impl("brgemm_pack", &brgemm_pack);
  m.impl("quant_linear", &quant_linear_op);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_rows", &quant_rows);
#ifdef __AVX512F__
  m.impl("nucleus_draws", &sampler::nucleus_draws);
#endif
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CatchAll, m) {
  // CatchAll: its weights include oneDNN-packed (MkldnnCPU) tensors, which select no CPU kernel.
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_calibrate", &packed_linear_calibrate);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("parallel_threads", &parallel_threads);
  m.impl("small_linear_rows", &small_linear_rows);
  m.impl("brgemm_linear_available", &brgemm_linear_available);
  m.impl("brgemm_block_n", &brgemm_block_n);
  m.impl("attention_isa", &attention_isa);
  m.impl("quant_linear_isa", &quant_linear_isa);
  m.impl("quant_onednn_rows", &quant_onednn_rows);
  m.impl("quant_vnni_rows", &quant_vnni_rows);
  m.impl("quant_vnni_tile_rows", &quant_vnni_tile_rows);
  m.impl("quant_set_int8_activations", &quant_set_int8_activations);
  m.impl("quant_release_scratch", &quant_release_scratch);
  m.impl("quant_float_vnni", &quant_float_vnni);
  m.impl("prompt_tiles_min_tokens", &prompt_tiles_min_tokens);
  m.impl("decode_tiles_min_group", &decode_tiles_min_group);
  m.impl("has_nucleus_draws", &sampler::has_nucleus_draws);
  m.impl("avx512_attention", &uses_avx512_attention);
}
