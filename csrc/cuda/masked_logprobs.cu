// CUDA kernels of dllm_fast::masked_logprobs (CUDA headers only; see masked_logprobs.cuh for the contract).
// The GEMMs that produce each logits chunk run in cuBLAS from masked_logprobs_glue.cpp; these kernels are the
// memory-bound parts: an online logsumexp over the chunk, the chunk's softmax gradient for backward, and
// masked_logprobs_grad's chunk step (gradient and measured normaliser in one pass) and its final correction.
// The two gradient kernels write d(logits) in the accumulator type or rounded once to the model's 16-bit type.

#include <type_traits>

#include "device_math.cuh"
#include "launch.cuh"
#include "masked_logprobs.cuh"

namespace dllm_fast::cuda {
namespace {

// A block per row (striding over rows beyond the grid): each thread folds its strided columns into (m, s), the
// block merges them, and thread 0 merges the chunk's pair into the row's running one.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    chunk_logsumexp_kernel(const acc_t* __restrict__ logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                           const int64_t* __restrict__ targets, acc_t* __restrict__ run_max,
                           acc_t* __restrict__ run_sum, acc_t* __restrict__ target_logit) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
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
}

template <typename acc_t>
__global__ void finalize_kernel(int64_t rows, const acc_t* __restrict__ run_max, const acc_t* __restrict__ run_sum,
                                const acc_t* __restrict__ target_logit, acc_t* __restrict__ lse,
                                acc_t* __restrict__ logp) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows; i += int64_t{gridDim.x} * blockDim.x) {
    const acc_t l = logsumexp_value(run_max[i], run_sum[i]);
    lse[i] = l;
    logp[i] = target_logit[i] - l;  // target_logit stays NaN for an out-of-vocabulary target
  }
}

// A block per row, threads striding over the chunk's columns. `grad` may be `logits` itself (grad_t = acc_t):
// each thread reads a column before it writes it.
template <typename acc_t, typename grad_t>
__global__ void __launch_bounds__(kThreads)
    softmax_grad_kernel(const acc_t* logits, grad_t* grad, const float* __restrict__ grad_scale, int64_t rows,
                        int64_t cols, int64_t ld, int64_t v0, const int64_t* __restrict__ targets,
                        const acc_t* __restrict__ lse, const acc_t* __restrict__ grad_logp,
                        const acc_t* __restrict__ grad_lse) {
  const acc_t output_scale = grad_scale ? acc_t(*grad_scale) : acc_t(1);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const acc_t g_lp = grad_logp ? grad_logp[row] : acc_t(0);
    const acc_t g_lse = grad_lse ? grad_lse[row] : acc_t(0);
    const acc_t scale = g_lse - g_lp, shift = lse[row];
    const int64_t target_col = targets[row] - v0;
    const acc_t* x = logits + row * ld;
    grad_t* out = grad + row * ld;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      acc_t v = scale * exp_acc(x[j] - shift);
      if (j == target_col) v += g_lp;
      store_rounded(out + j, v * output_scale);
    }
  }
}

// A block per row: each thread turns its strided columns into g (onehot - e) and sums their e, the block adds
// the sums, and thread 0 adds the chunk's sum to the row's. The one thread that owns the target column reads
// the target logit. `grad` may be `logits` itself, as above.
template <typename acc_t, typename grad_t>
__global__ void __launch_bounds__(kThreads)
    known_grad_kernel(const acc_t* logits, grad_t* grad, const float* __restrict__ grad_scale, int64_t rows,
                      int64_t cols, int64_t ld, int64_t v0, const int64_t* __restrict__ targets,
                      const acc_t* __restrict__ lse, const acc_t* __restrict__ grad_logp, acc_t* __restrict__ sum_e,
                      acc_t* __restrict__ target_logit) {
  const acc_t output_scale = grad_scale ? acc_t(*grad_scale) : acc_t(1);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const acc_t g = grad_logp[row], shift = lse[row];
    const int64_t target_col = targets[row] - v0;
    const acc_t* x = logits + row * ld;
    grad_t* out = grad + row * ld;
    acc_t s = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const acc_t logit = x[j], e = exp_acc(logit - shift);
      s += e;
      acc_t v = -g * e;
      if (j == target_col) {
        target_logit[row] = logit;
        v += g;
      }
      store_rounded(out + j, v * output_scale);
    }
    s = block_reduce(s, [](acc_t a, acc_t b) { return a + b; });
    if (threadIdx.x == 0) sum_e[row] += s;
  }
}

// Calls launch(the output's data as a typed pointer) for its element type; a 16-bit type takes a float
// accumulator only.
template <typename acc_t, typename Launch>
cudaError_t with_grad_type(GradOutput grad, Launch&& launch) {
  switch (grad.type) {
    case GradType::kAccumulate: return launch(static_cast<acc_t*>(grad.data));
    case GradType::kBFloat16:
      if constexpr (std::is_same_v<acc_t, float>) return launch(static_cast<__nv_bfloat16*>(grad.data));
      break;
    case GradType::kHalf:
      if constexpr (std::is_same_v<acc_t, float>) return launch(static_cast<__half*>(grad.data));
      break;
  }
  return cudaErrorInvalidValue;
}

// A block per row, threads striding over the hidden width; thread 0 writes the row's logp.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    finalize_known_grad_kernel(int64_t rows, int64_t width, const acc_t* __restrict__ sum_e,
                               const acc_t* __restrict__ target_logit, const acc_t* __restrict__ lse,
                               const acc_t* __restrict__ grad_logp, const acc_t* __restrict__ target_rows,
                               acc_t* __restrict__ grad_h, acc_t* __restrict__ logp) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const acc_t S = sum_e[row], inverse = acc_t(1) / S, g = grad_logp[row];
    if (threadIdx.x == 0) logp[row] = target_logit[row] - lse[row] - log_acc(S);  // NaN for a target outside
    const acc_t* w = target_rows + row * width;
    acc_t* out = grad_h + row * width;
    for (int64_t k = threadIdx.x; k < width; k += blockDim.x) {
      out[k] = out[k] * inverse + g * w[k] * (acc_t(1) - inverse);
    }
  }
}

}  // namespace

template <typename acc_t>
cudaError_t launch_chunk_logsumexp(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                   const int64_t* targets, acc_t* run_max, acc_t* run_sum, acc_t* target_logit,
                                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(row_grid(rows), kThreads, 0, stream, chunk_logsumexp_kernel<acc_t>)(
      logits, rows, cols, ld, v0, targets, run_max, run_sum, target_logit);
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_finalize_logprobs(int64_t rows, const acc_t* run_max, const acc_t* run_sum,
                                     const acc_t* target_logit, acc_t* lse, acc_t* logp, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(item_grid(rows, kThreads), kThreads, 0, stream, finalize_kernel<acc_t>)(
      rows, run_max, run_sum, target_logit, lse, logp);
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_chunk_softmax_grad(const acc_t* logits, GradOutput grad, int64_t rows, int64_t cols, int64_t ld,
                                      int64_t v0, const int64_t* targets, const acc_t* lse, const acc_t* grad_logp,
                                      const acc_t* grad_lse, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return with_grad_type<acc_t>(grad, [&](auto* out) {
    using grad_t = std::remove_pointer_t<decltype(out)>;
    DLLM_FAST_LAUNCH(row_grid(rows), kThreads, 0, stream, softmax_grad_kernel<acc_t, grad_t>)(
        logits, out, grad.scale, rows, cols, ld, v0, targets, lse, grad_logp, grad_lse);
    return cudaGetLastError();
  });
}

template <typename acc_t>
cudaError_t launch_chunk_known_grad(const acc_t* logits, GradOutput grad, int64_t rows, int64_t cols, int64_t ld,
                                    int64_t v0, const int64_t* targets, const acc_t* lse, const acc_t* grad_logp,
                                    acc_t* sum_e, acc_t* target_logit, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return with_grad_type<acc_t>(grad, [&](auto* out) {
    using grad_t = std::remove_pointer_t<decltype(out)>;
    DLLM_FAST_LAUNCH(row_grid(rows), kThreads, 0, stream, known_grad_kernel<acc_t, grad_t>)(
        logits, out, grad.scale, rows, cols, ld, v0, targets, lse, grad_logp, sum_e, target_logit);
    return cudaGetLastError();
  });
}

template <typename acc_t>
cudaError_t launch_finalize_known_grad(int64_t rows, int64_t width, const acc_t* sum_e, const acc_t* target_logit,
                                       const acc_t* lse, const acc_t* grad_logp, const acc_t* target_rows,
                                       acc_t* grad_h, acc_t* logp, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(row_grid(rows), kThreads, 0, stream, finalize_known_grad_kernel<acc_t>)(
      rows, width, sum_e, target_logit, lse, grad_logp, target_rows, grad_h, logp);
  return cudaGetLastError();
}

template cudaError_t launch_chunk_logsumexp<float>(const float*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                                   float*, float*, float*, cudaStream_t);
template cudaError_t launch_chunk_logsumexp<double>(const double*, int64_t, int64_t, int64_t, int64_t,
                                                    const int64_t*, double*, double*, double*, cudaStream_t);
template cudaError_t launch_finalize_logprobs<float>(int64_t, const float*, const float*, const float*, float*,
                                                     float*, cudaStream_t);
template cudaError_t launch_finalize_logprobs<double>(int64_t, const double*, const double*, const double*, double*,
                                                      double*, cudaStream_t);
template cudaError_t launch_chunk_softmax_grad<float>(const float*, GradOutput, int64_t, int64_t, int64_t, int64_t,
                                                      const int64_t*, const float*, const float*, const float*,
                                                      cudaStream_t);
template cudaError_t launch_chunk_softmax_grad<double>(const double*, GradOutput, int64_t, int64_t, int64_t, int64_t,
                                                       const int64_t*, const double*, const double*, const double*,
                                                       cudaStream_t);
template cudaError_t launch_chunk_known_grad<float>(const float*, GradOutput, int64_t, int64_t, int64_t, int64_t,
                                                    const int64_t*, const float*, const float*, float*, float*,
                                                    cudaStream_t);
template cudaError_t launch_chunk_known_grad<double>(const double*, GradOutput, int64_t, int64_t, int64_t, int64_t,
                                                     const int64_t*, const double*, const double*, double*, double*,
                                                     cudaStream_t);
template cudaError_t launch_finalize_known_grad<float>(int64_t, int64_t, const float*, const float*, const float*,
                                                       const float*, const float*, float*, float*, cudaStream_t);
template cudaError_t launch_finalize_known_grad<double>(int64_t, int64_t, const double*, const double*,
                                                        const double*, const double*, const double*, double*,
                                                        double*, cudaStream_t);

}  // namespace dllm_fast::cuda
