// Row kernels for the CPU ops: max, sum of exponentials and the softmax-gradient transform over one
// contiguous row. The float versions are compiled for AVX-512, AVX2 and baseline x86-64, and the loader
// picks one (GCC target_clones; hence `static`: one resolver per translation unit). That way the loops
// vectorise on the machine they run on without a -march flag that would break elsewhere. The double
// versions are plain loops; they serve gradcheck.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DLLM_FAST_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DLLM_FAST_MULTIVERSION
#endif

namespace dllm_fast::cpu {

// exp(x) for float with about 1 ulp of error (Cephes' polynomial). Branch-free, so `omp simd` loops that call
// it vectorise; std::exp would not. Inputs below -87.3 return exactly 0, so exp(-inf) = 0; NaN propagates.
inline __attribute__((always_inline)) float expf_vec(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds a float to the nearest integer
  constexpr float kMin = -87.33654f;
  constexpr float kMax = 88.72283f;
  // Ternaries rather than std::min/max: they if-convert into vector selects.
  float xc = x < kMin ? kMin : x;
  xc = xc > kMax ? kMax : xc;
  const float t = xc * kLog2e + kRound;
  const float k = t - kRound;
  const int32_t ki = __builtin_bit_cast(int32_t, t) - __builtin_bit_cast(int32_t, kRound);
  const float r = (xc - k * kLn2Hi) - k * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float y = p * __builtin_bit_cast(float, (ki + 127) << 23);
  return x < kMin ? 0.0f : y;
}

DLLM_FAST_MULTIVERSION
[[maybe_unused]] static float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

DLLM_FAST_MULTIVERSION
[[maybe_unused]] static float row_sum_exp(const float* x, int64_t n, float shift) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += expf_vec(x[j] - shift);
  return s;
}

// x[j] <- scale * exp(x[j] - shift): the softmax part of the log-prob gradient.
DLLM_FAST_MULTIVERSION
[[maybe_unused]] static void row_scaled_exp(float* x, int64_t n, float shift, float scale) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] = scale * expf_vec(x[j] - shift);
}

[[maybe_unused]] static double row_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

[[maybe_unused]] static double row_sum_exp(const double* x, int64_t n, double shift) {
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(x[j] - shift);
  return s;
}

[[maybe_unused]] static void row_scaled_exp(double* x, int64_t n, double shift, double scale) {
  for (int64_t j = 0; j < n; ++j) x[j] = scale * std::exp(x[j] - shift);
}

}  // namespace dllm_fast::cpu
