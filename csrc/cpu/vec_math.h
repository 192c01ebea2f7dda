// Row kernels for the CPU ops: max, sum of exponentials, the online logsumexp update and the
// softmax-gradient transform over one contiguous row. The float versions are compiled for AVX-512, AVX2 and baseline x86-64, and the loader
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

// cond ? a : b with bit masks: GCC vectorises this where it turns some ternaries into branches.
inline __attribute__((always_inline)) int32_t select_bits(bool cond, int32_t a, int32_t b) {
  const int32_t mask = -static_cast<int32_t>(cond);
  return (a & mask) | (b & ~mask);
}

// log(x) for float with about 1 ulp of error (Cephes' polynomial), branch-free like expf_vec.
// log(0) = -inf, log(inf) = inf, negative or NaN inputs give NaN; subnormal inputs are treated as 0.
inline __attribute__((always_inline)) float logf_vec(float x) {
  const int32_t bits = __builtin_bit_cast(int32_t, x);
  int32_t mantissa = (bits & 0x007fffff) | 0x3f800000;  // m in [1, 2)
  const int32_t big = mantissa > 0x3fb504f3 ? 1 : 0;    // m > sqrt(2): halve it so m is in [sqrt(1/2), sqrt(2))
  mantissa -= big << 23;
  const float e = static_cast<float>(((bits >> 23) & 0xff) - 127 + big);
  const float f = __builtin_bit_cast(float, mantissa) - 1.0f;
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  int32_t result = __builtin_bit_cast(int32_t, f + y + 0.693359375f * e);
  result = select_bits(bits < 0x00800000, int32_t(0xff800000), result);        // +0 and subnormals: -inf
  result = select_bits(bits == 0x7f800000, bits, result);                      // +inf
  result = select_bits((bits < 0) | (bits > 0x7f800000), 0x7fc00000, result); // negative or NaN: NaN
  return __builtin_bit_cast(float, result);
}

// A standard Gumbel sample from a uniform v in (0, 1]: -log(E) with E = -log1p(-v) ~ Exp(1). E comes from
// v, not from 1 - v, so small E (large Gumbel values: the argmax winners) keeps full relative precision;
// log1p uses Goldberg's correction. v = 1 gives -inf, a value that never wins.
inline __attribute__((always_inline)) float gumbel_from_uniform(float v) {
  const float u = 1.0f - v;
  const int32_t corrected = __builtin_bit_cast(int32_t, logf_vec(u) * (-v / (u - 1.0f)));  // NaN when u == 1
  const int32_t plain = __builtin_bit_cast(int32_t, -v);  // log1p(-v) = -v to float precision when 1 - v == 1
  const float log1p_neg_v = __builtin_bit_cast(float, select_bits(u == 1.0f, plain, corrected));
  return -logf_vec(-log1p_neg_v);
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

// x[j] <- scale * exp(x[j] - shift), returning the sum of exp(x[j] - shift) over the row (before scaling): the
// softmax-gradient transform of masked_logprobs_grad, which also measures how far the row's given
// normaliser is from its true one (the sum is 1 when `shift` is exactly the row's logsumexp).
DLLM_FAST_MULTIVERSION
[[maybe_unused]] static float row_scaled_exp_sum(float* x, int64_t n, float shift, float scale) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    const float e = expf_vec(x[j] - shift);
    s += e;
    x[j] = scale * e;
  }
  return s;
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

[[maybe_unused]] static double row_scaled_exp_sum(double* x, int64_t n, double shift, double scale) {
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double e = std::exp(x[j] - shift);
    s += e;
    x[j] = scale * e;
  }
  return s;
}

// The online logsumexp update, shared by every CPU kernel: folds the chunk x[0, n) into a running pair
// (run_max, run_sum = sum of exp(x - run_max)) that starts at (-inf, 0). A chunk holding only -inf adds
// nothing; shifting it by its own max would give exp(-inf - -inf) = NaN. A NaN entry poisons the sum.
// `static` like the row kernels it calls, so each translation unit keeps its own copy.
template <typename acc_t>
static inline void online_logsumexp_update(acc_t& run_max, acc_t& run_sum, const acc_t* x, int64_t n) {
  const acc_t chunk_max = row_max(x, n);  // NaN entries are skipped here, and caught by the sums below
  const acc_t m = run_max > chunk_max ? run_max : chunk_max;
  if (m == -std::numeric_limits<acc_t>::infinity()) {
    run_sum += row_sum_exp(x, n, acc_t(0));  // 0 for -inf entries, NaN if any entry is NaN
    return;
  }
  run_sum = run_sum * std::exp(run_max - m) + row_sum_exp(x, n, m);
  run_max = m;
}

}  // namespace dllm_fast::cpu
