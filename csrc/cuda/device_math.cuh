// Device helpers shared by the CUDA kernels: precision-generic exp/log, the online logsumexp, and block-wide
// reductions that work for any block size, written once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "launch.cuh"

namespace dllm_fast::cuda {

constexpr int kThreads = 256;  // the row kernels' block size

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// Stores an accumulator value as the output's type: as it is, or rounded to nearest even to bf16/fp16.
__device__ __forceinline__ void store_rounded(float* out, float v) { *out = v; }
__device__ __forceinline__ void store_rounded(double* out, double v) { *out = v; }
__device__ __forceinline__ void store_rounded(__nv_bfloat16* out, float v) { *out = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_rounded(__half* out, float v) { *out = __float2half_rn(v); }

// Loads a value of the input's type as the accumulator type (bf16 and fp16 widen exactly).
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(float v) { return static_cast<acc_t>(v); }
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(double v) { return static_cast<acc_t>(v); }
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(__nv_bfloat16 v) { return static_cast<acc_t>(__bfloat162float(v)); }
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(__half v) { return static_cast<acc_t>(__half2float(v)); }

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

// The value of a pair: -inf for an empty one.
template <typename acc_t>
__device__ __forceinline__ acc_t logsumexp_value(acc_t m, acc_t s) {
  return m + log_acc(s);
}

template <typename acc_t>
struct LogSumExp {
  acc_t m, s;
};

// shuffle_down(mask, value, offset): __shfl_down_sync for a scalar or, field by field, for the reduction's own
// types (an overload next to each type; block_reduce finds it by argument-dependent lookup).
template <typename T>
__device__ __forceinline__ std::enable_if_t<std::is_arithmetic_v<T>, T> shuffle_down(unsigned mask, T value,
                                                                                       unsigned offset) {
  return __shfl_down_sync(mask, value, offset);
}

template <typename acc_t>
__device__ __forceinline__ LogSumExp<acc_t> shuffle_down(unsigned mask, LogSumExp<acc_t> value, unsigned offset) {
  return LogSumExp<acc_t>{__shfl_down_sync(mask, value.m, offset), __shfl_down_sync(mask, value.s, offset)};
}

// Combines one value per thread of a 1-D block with `combine` (associative) and returns the result to every
// thread. Works for any blockDim.x: lanes past the end of a partial last warp are neither named in a shuffle
// mask nor combined. Every thread must call it; it ends with a barrier, so it may be called again at once.
template <typename T, typename Combine>
__device__ __forceinline__ T block_reduce(T value, Combine combine) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  const unsigned lanes = min(32u, blockDim.x - warp * 32);
  const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  for (unsigned offset = 16; offset > 0; offset >>= 1) {
    const T other = shuffle_down(mask, value, offset);
    if (lane + offset < lanes) value = combine(value, other);
  }
  __shared__ SharedArray<T, 32> partial;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  T total = partial[0];
  for (unsigned w = 1; w < warps; ++w) total = combine(total, static_cast<T>(partial[w]));
  __syncthreads();  // before a next call overwrites partial
  return total;
}

// Merges the pairs (m, s) of all threads of the block: every thread ends with the block's pair. Every thread
// must call it; any block size.
template <typename acc_t>
__device__ __forceinline__ void block_logsumexp(acc_t& m, acc_t& s) {
  const LogSumExp<acc_t> total = block_reduce(LogSumExp<acc_t>{m, s}, [](LogSumExp<acc_t> a, LogSumExp<acc_t> b) {
    logsumexp_merge(a.m, a.s, b.m, b.s);
    return a;
  });
  m = total.m;
  s = total.s;
}

}  // namespace dllm_fast::cuda
