// exp as a Cephes-style polynomial (relative error ~1e-7, like the SLEEF exp of PyTorch's vectorised
// kernels), shared by the ops of cpu_ops.cpp and the sampler (sampler.h). Why not std::exp: this one
// vectorises in the compilers' `omp simd` loops, and avx512_attention::exp512 is the same polynomial,
// 16 lanes at once, so a scalar tail agrees with the vector body it finishes.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float exp_approx(float x) {
  // exp(x) = 2^n * exp(r), r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 polynomial for exp(r).
  x = std::min(std::max(x, -87.0f), 88.0f);
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  int32_t n = static_cast<int32_t>(fx);
  int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

}  // namespace
