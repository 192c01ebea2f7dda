// CUDA kernels of dllm_fast::masked_logprobs (CUDA headers only; see masked_logprobs.cuh for the contract).
// The GEMMs that produce each logits chunk run in cuBLAS from masked_logprobs_glue.cpp; these kernels are the
// memory-bound parts: an online logsumexp over the chunk, and the in-place softmax gradient for backward.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "device_math.cuh"
#include "masked_logprobs.cuh"

namespace dllm_fast::cuda {
namespace {

// One block per row: each thread folds its strided columns into (m, s), the block merges them, and thread 0
// merges the chunk's pair into the row's running one.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    chunk_logsumexp_kernel(const acc_t* __restrict__ logits, int64_t cols, int64_t ld, int64_t v0,
                           const int64_t* __restrict__ targets, acc_t* __restrict__ run_max,
                           acc_t* __restrict__ run_sum, acc_t* __restrict__ target_logit) {
  const int64_t row = blockIdx.x;
  const acc_t* x = logits + row * ld;
  acc_t m = -INFINITY, s = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) logsumexp_add(m, s, x[j]);
  block_logsumexp(m, s);
  if (threadIdx.x == 0) {
    logsumexp_merge(run_max[row], run_sum[row], m, s);
    const int64_t col = targets[row] - v0;
    if (col >= 0 && col < cols) target_logit[row] = x[col];
  }
}

template <typename acc_t>
__global__ void finalize_kernel(int64_t rows, const acc_t* __restrict__ run_max, const acc_t* __restrict__ run_sum,
                                const acc_t* __restrict__ target_logit, acc_t* __restrict__ lse,
                                acc_t* __restrict__ logp) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  const acc_t l = logsumexp_value(run_max[i], run_sum[i]);
  lse[i] = l;
  logp[i] = target_logit[i] - l;  // target_logit stays NaN for an out-of-vocabulary target
}

// torch builds with __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__, so 16-bit outputs need the
// explicit intrinsics (the double -> 16-bit paths are never taken, but they must compile).
template <typename out_t, typename acc_t>
__device__ __forceinline__ out_t cast_out(acc_t v) {
  if constexpr (std::is_same_v<out_t, __nv_bfloat16>) {
    return __float2bfloat16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<out_t, __half>) {
    return __float2half(static_cast<float>(v));
  } else {
    return static_cast<out_t>(v);
  }
}

// One block per row, threads striding over the chunk's columns. `logits` is not __restrict__: for fp32/fp64
// the gradient is written in place (dlogits aliases logits).
template <typename acc_t, typename out_t>
__global__ void softmax_grad_kernel(const acc_t* logits, int64_t cols, int64_t ld, int64_t v0,
                                    const int64_t* __restrict__ targets, const acc_t* __restrict__ lse,
                                    const acc_t* __restrict__ grad_logp, const acc_t* __restrict__ grad_lse,
                                    out_t* dlogits, int64_t ld_out) {
  const int64_t row = blockIdx.x;
  const acc_t g_lp = grad_logp ? grad_logp[row] : acc_t(0);
  const acc_t g_lse = grad_lse ? grad_lse[row] : acc_t(0);
  const acc_t scale = g_lse - g_lp, shift = lse[row];
  const int64_t target_col = targets[row] - v0;
  const acc_t* x = logits + row * ld;
  out_t* out = dlogits + row * ld_out;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    acc_t v = scale * exp_acc(x[j] - shift);
    if (j == target_col) v += g_lp;
    out[j] = cast_out<out_t>(v);
  }
}

template <typename acc_t, typename out_t>
cudaError_t launch_softmax_grad_typed(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                      const int64_t* targets, const acc_t* lse, const acc_t* grad_logp,
                                      const acc_t* grad_lse, void* dlogits, int64_t ld_out, cudaStream_t stream) {
  DLLM_FAST_LAUNCH(static_cast<unsigned>(rows), kThreads, 0, stream, softmax_grad_kernel<acc_t, out_t>)(
      logits, cols, ld, v0, targets, lse, grad_logp, grad_lse, static_cast<out_t*>(dlogits), ld_out);
  return cudaGetLastError();
}

}  // namespace

template <typename acc_t>
cudaError_t launch_chunk_logsumexp(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                   const int64_t* targets, acc_t* run_max, acc_t* run_sum, acc_t* target_logit,
                                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(static_cast<unsigned>(rows), kThreads, 0, stream, chunk_logsumexp_kernel<acc_t>)(
      logits, cols, ld, v0, targets, run_max, run_sum, target_logit);
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_finalize_logprobs(int64_t rows, const acc_t* run_max, const acc_t* run_sum,
                                     const acc_t* target_logit, acc_t* lse, acc_t* logp, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  DLLM_FAST_LAUNCH(blocks, kThreads, 0, stream, finalize_kernel<acc_t>)(rows, run_max, run_sum, target_logit, lse, logp);
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_chunk_softmax_grad(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                      const int64_t* targets, const acc_t* lse, const acc_t* grad_logp,
                                      const acc_t* grad_lse, void* dlogits, ScalarKind out_kind, int64_t ld_out,
                                      cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  switch (out_kind) {
    case ScalarKind::kBFloat16:
      return launch_softmax_grad_typed<acc_t, __nv_bfloat16>(logits, rows, cols, ld, v0, targets, lse, grad_logp,
                                                             grad_lse, dlogits, ld_out, stream);
    case ScalarKind::kFloat16:
      return launch_softmax_grad_typed<acc_t, __half>(logits, rows, cols, ld, v0, targets, lse, grad_logp,
                                                      grad_lse, dlogits, ld_out, stream);
    case ScalarKind::kFloat32:
      return launch_softmax_grad_typed<acc_t, float>(logits, rows, cols, ld, v0, targets, lse, grad_logp,
                                                     grad_lse, dlogits, ld_out, stream);
    case ScalarKind::kFloat64:
      return launch_softmax_grad_typed<acc_t, double>(logits, rows, cols, ld, v0, targets, lse, grad_logp,
                                                      grad_lse, dlogits, ld_out, stream);
  }
  return cudaErrorInvalidValue;
}

template cudaError_t launch_chunk_logsumexp<float>(const float*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                                   float*, float*, float*, cudaStream_t);
template cudaError_t launch_chunk_logsumexp<double>(const double*, int64_t, int64_t, int64_t, int64_t,
                                                    const int64_t*, double*, double*, double*, cudaStream_t);
template cudaError_t launch_finalize_logprobs<float>(int64_t, const float*, const float*, const float*, float*,
                                                     float*, cudaStream_t);
template cudaError_t launch_finalize_logprobs<double>(int64_t, const double*, const double*, const double*, double*,
                                                      double*, cudaStream_t);
template cudaError_t launch_chunk_softmax_grad<float>(const float*, int64_t, int64_t, int64_t, int64_t,
                                                      const int64_t*, const float*, const float*, const float*,
                                                      void*, ScalarKind, int64_t, cudaStream_t);
template cudaError_t launch_chunk_softmax_grad<double>(const double*, int64_t, int64_t, int64_t, int64_t,
                                                       const int64_t*, const double*, const double*, const double*,
                                                       void*, ScalarKind, int64_t, cudaStream_t);

}  // namespace dllm_fast::cuda
