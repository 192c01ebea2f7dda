// Device helpers shared by the CUDA kernels: precision-generic exp/log and the online logsumexp, written once.
#pragma once

#include <cmath>

#include "launch.cuh"

namespace dllm_fast::cuda {

constexpr int kThreads = 256;  // every row kernel runs one block of kThreads threads per row
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// The online logsumexp. A pair (m, s) stands for logsumexp = m + log(s) of the values folded into it, with
// s = sum of exp(x - m); it starts empty at (-inf, 0). A -inf value adds nothing, so a thread, warp or whole
// vocabulary chunk that saw only -inf stays (-inf, 0) instead of computing exp(-inf - -inf) = NaN. A NaN
// value poisons s, and the poison survives every merge.

// Fold one value into (m, s).
template <typename acc_t>
__device__ __forceinline__ void logsumexp_add(acc_t& m, acc_t& s, acc_t x) {
  if (x > m) {
    s = s * exp_acc(m - x) + acc_t(1);
    m = x;
  } else if (x != -INFINITY) {  // a NaN lands here
    s += exp_acc(x - m);
  }
}

// Merge another pair into (m, s). Pairs combine associatively, so threads, warps and chunks merge in any order.
template <typename acc_t>
__device__ __forceinline__ void logsumexp_merge(acc_t& m, acc_t& s, acc_t other_m, acc_t other_s) {
  const acc_t new_m = m > other_m ? m : other_m;
  if (new_m == -INFINITY) {  // both sides hold only -inf: their sums are 0, or NaN if poisoned
    s += other_s;
    return;
  }
  s = s * exp_acc(m - new_m) + other_s * exp_acc(other_m - new_m);
  m = new_m;
}

// Merge the pairs of all kThreads threads of the block; thread 0 ends with the block's pair. Every thread of
// the block must call it (it synchronises the block).
template <typename acc_t>
__device__ __forceinline__ void block_logsumexp(acc_t& m, acc_t& s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    logsumexp_merge(m, s, __shfl_down_sync(0xffffffffu, m, offset), __shfl_down_sync(0xffffffffu, s, offset));
  }
  __shared__ SharedArray<acc_t, kWarps> warp_m, warp_s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) logsumexp_merge<acc_t>(m, s, warp_m[w], warp_s[w]);
  }
}

// The value of a pair: -inf for an empty one.
template <typename acc_t>
__device__ __forceinline__ acc_t logsumexp_value(acc_t m, acc_t s) {
  return m + log_acc(s);
}

}  // namespace dllm_fast::cuda
