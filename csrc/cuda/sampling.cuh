// Launchers of the sampling CUDA kernels. Torch-free: raw pointers, sizes and a stream (the torch side is
// sample_tokens_glue.cpp and select_transfer_glue.cpp).
// `logits` is one vocabulary chunk [rows, cols] (leading dimension ld) holding columns v0 .. v0 + cols - 1,
// with v0 a multiple of 4 (one Philox call covers four columns).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace dllm_fast::cuda {

// A short list of token ids, passed by value so no device copy is needed.
struct TokenList {
  static constexpr int kCapacity = 8;
  int64_t ids[kCapacity];
  int count;
};

// Running per-row sampling state across chunks. Initialise best_score and run_max to -inf, best_token to -1,
// run_sum to 0.
template <typename acc_t>
struct SampleState {
  acc_t* best_score;
  int64_t* best_token;
  acc_t* best_logit;
  acc_t* run_max;
  acc_t* run_sum;
};

// Fold one chunk into the state: Gumbel-max over logits * logit_scale + noise_scale * noise (argmax when
// greedy), ties to the lowest id; logsumexp of the unscaled logits without the excluded ids. Suppressed ids
// count as -inf. (logit_scale, noise_scale) is (1, T) for T < 1 and (1 / T, 1) otherwise: never overflows.
template <typename acc_t>
cudaError_t launch_sample_chunk(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                const int64_t* row_ids, bool greedy, acc_t logit_scale, acc_t noise_scale,
                                uint64_t seed, uint32_t offset, TokenList suppress, TokenList exclude,
                                SampleState<acc_t> state, cudaStream_t stream);

// tokens = best_token; confidence = exp(best_logit - logsumexp), 0 for an excluded token, NaN (token -1) for
// a row with no finite logit.
template <typename acc_t>
cudaError_t launch_sample_finalize(int64_t rows, TokenList exclude, SampleState<acc_t> state, int64_t* tokens,
                                   acc_t* confidence, cudaStream_t stream);

// transfer[b, i] for candidates: rank among the row's candidates by descending confidence (ties to the lowest
// position; NaN ranks as -inf, -0 as +0) below counts[b] (threshold < 0), or rank 0 or confidence >= threshold.
template <typename conf_t>
cudaError_t launch_select_transfer(const conf_t* confidence, const bool* candidates, const int64_t* counts,
                                   int64_t rows, int64_t n, double threshold, bool* transfer, cudaStream_t stream);

}  // namespace dllm_fast::cuda
