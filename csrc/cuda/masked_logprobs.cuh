// Launchers of the masked_logprobs CUDA kernels. Torch-free: raw pointers, sizes and a stream, so this header
// and the kernels compile with nvcc alone; masked_logprobs_glue.cpp connects them to tensors and runs the GEMMs.
//
// Row-major layouts. `logits` is one vocabulary chunk: [rows, cols] with leading dimension `ld`, holding the
// columns v0 .. v0 + cols - 1 of the full logits, in the accumulator type: float for fp32/bf16/fp16 inputs and
// double for fp64 inputs, as are run_max, run_sum, target_logit, lse and logp.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace dllm_fast::cuda {

// Merge one chunk into the running logsumexp of every row and pick up the target logits that fall in it.
// Initialise run_max to -inf, run_sum to 0 and target_logit to NaN before the first chunk.
template <typename acc_t>
cudaError_t launch_chunk_logsumexp(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                   const int64_t* targets, acc_t* run_max, acc_t* run_sum, acc_t* target_logit,
                                   cudaStream_t stream);

// lse = run_max + log(run_sum); logp = target_logit - lse (NaN where the target was outside the vocabulary).
template <typename acc_t>
cudaError_t launch_finalize_logprobs(int64_t rows, const acc_t* run_max, const acc_t* run_sum,
                                     const acc_t* target_logit, acc_t* lse, acc_t* logp, cudaStream_t stream);

// The element type of the d(logits) that the two gradient kernels below write: the accumulator type (then the
// output may be `logits` itself, updated in place), or the model's 16-bit type, each value computed in the
// accumulator type and rounded once, to nearest even, for model-dtype gradient GEMMs.
enum class GradType { kAccumulate, kBFloat16, kHalf };

// Where a gradient kernel writes d(logits): `data`, with the logits' layout, as `type`, each value multiplied by
// *scale before it is rounded (null: by 1). The scale is a power of two that lifts an fp16 softmax's tail out of
// fp16's subnormals; the glue divides the GEMMs' fp32 results by it again (both exact).
struct GradOutput {
  void* data;
  GradType type;
  const float* scale;
};

// grad <- (g_lse - g_logp) * exp(logits - lse) + g_logp * onehot(target): the gradient of
// sum(g_logp * logp + g_lse * lse) with respect to one chunk of logits. Either upstream gradient may be null
// (zero).
template <typename acc_t>
cudaError_t launch_chunk_softmax_grad(const acc_t* logits, GradOutput grad, int64_t rows, int64_t cols, int64_t ld,
                                      int64_t v0, const int64_t* targets, const acc_t* lse, const acc_t* grad_logp,
                                      const acc_t* grad_lse, cudaStream_t stream);

// masked_logprobs_grad's chunk step, for an upstream gradient g known up front and a logsumexp `lse` that may be
// a little off: e = exp(logits - lse); sum_e += sum of e over the chunk (the measured normaliser S, 1 for an
// exact lse); target_logit picks up the target's logit; then grad <- g * (onehot(target) - e). Initialise sum_e
// to 0 and target_logit to NaN before the first chunk. g must be 0 for an out-of-range target.
template <typename acc_t>
cudaError_t launch_chunk_known_grad(const acc_t* logits, GradOutput grad, int64_t rows, int64_t cols, int64_t ld,
                                    int64_t v0, const int64_t* targets, const acc_t* lse, const acc_t* grad_logp,
                                    acc_t* sum_e, acc_t* target_logit, cudaStream_t stream);

// masked_logprobs_grad's last step, once every chunk is walked: logp = target_logit - lse - log(S), and grad_h
// [rows, width] (accumulated with e in place of the true softmax e / S) corrected in place to
// grad_h / S + g * target_rows * (1 - 1 / S). target_rows [rows, width]: the weight's row of each target.
template <typename acc_t>
cudaError_t launch_finalize_known_grad(int64_t rows, int64_t width, const acc_t* sum_e, const acc_t* target_logit,
                                       const acc_t* lse, const acc_t* grad_logp, const acc_t* target_rows,
                                       acc_t* grad_h, acc_t* logp, cudaStream_t stream);

}  // namespace dllm_fast::cuda
