// Device helpers shared by the CUDA kernels: precision-generic exp/log and the logsumexp pair merge.
#pragma once

#include <cmath>

namespace dllm_fast::cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// (max, sum of exp(x - max)) pairs combine associatively; an empty side has max = -inf and sum = 0.
template <typename acc_t>
__device__ __forceinline__ void merge_logsumexp(acc_t& m, acc_t& s, acc_t other_m, acc_t other_s) {
  const acc_t new_m = m > other_m ? m : other_m;
  if (new_m == -INFINITY) return;  // both empty
  s = s * exp_acc(m - new_m) + other_s * exp_acc(other_m - new_m);
  m = new_m;
}

}  // namespace dllm_fast::cuda
