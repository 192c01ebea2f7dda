// Declarations of every backend implementation that csrc/registration.cpp registers.
// The schemas themselves (and their documentation) live in registration.cpp.
#pragma once

#include <array>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace dllm_fast {

using at::Tensor;

// Argument checks shared by every backend of masked_logprobs; they throw c10::Error with a full sentence.
void check_masked_logprobs_args(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                int64_t chunk_size);

// ... and of masked_logprobs_grad: the above plus grad_logp [M], lse [M] when given, and grad_weight (mutated)
// of weight's shape, dtype and device, contiguous.
void check_masked_logprobs_grad_args(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                     const Tensor& grad_logp, const std::optional<Tensor>& lse,
                                     const std::optional<Tensor>& grad_weight, int64_t chunk_size);

void check_sample_tokens_args(const Tensor& hidden, const Tensor& weight, const Tensor& row_ids, double temperature,
                              at::IntArrayRef suppress_ids, at::IntArrayRef confidence_exclude_ids,
                              int64_t chunk_size);
void check_select_transfer_args(const Tensor& confidence, const Tensor& candidates, const Tensor& counts,
                                double threshold);

// dtype of logp / lse / the fp32-or-fp64 accumulators for a given input dtype.
at::ScalarType accumulate_type(at::ScalarType input);

// The one float/double dispatch of every backend: calls fn with a value of the accumulator type of `input`
// (double for float64, float for float32, bfloat16 and float16) and returns what it returns:
//   return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) { return impl<decltype(acc)>(...); });
template <typename Fn>
auto dispatch_accumulate(at::ScalarType input, Fn&& fn) {
  if (accumulate_type(input) == at::kDouble) return fn(double{});
  return fn(float{});
}

std::tuple<Tensor, Tensor> masked_logprobs_cpu(const Tensor& hidden, const Tensor& weight,
                                               const Tensor& targets, int64_t chunk_size);
std::tuple<Tensor, Tensor> masked_logprobs_backward_cpu(
    const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_lse, const Tensor& hidden,
    const Tensor& weight, const Tensor& targets, const Tensor& lse, int64_t chunk_size,
    std::array<bool, 2> output_mask);

std::tuple<Tensor, Tensor> masked_logprobs_grad_cpu(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                                    const Tensor& grad_logp, const std::optional<Tensor>& lse,
                                                    const std::optional<Tensor>& grad_weight, int64_t chunk_size);

std::tuple<Tensor, Tensor> sample_tokens_cpu(const Tensor& hidden, const Tensor& weight, const Tensor& row_ids,
                                             double temperature, int64_t seed, int64_t offset,
                                             at::IntArrayRef suppress_ids, at::IntArrayRef confidence_exclude_ids,
                                             int64_t chunk_size);
Tensor select_transfer_cpu(const Tensor& confidence, const Tensor& candidates, const Tensor& counts,
                           double threshold);

#ifdef DLLM_FAST_WITH_CUDA
std::tuple<Tensor, Tensor> masked_logprobs_cuda(const Tensor& hidden, const Tensor& weight,
                                                const Tensor& targets, int64_t chunk_size);
std::tuple<Tensor, Tensor> masked_logprobs_backward_cuda(
    const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_lse, const Tensor& hidden,
    const Tensor& weight, const Tensor& targets, const Tensor& lse, int64_t chunk_size,
    std::array<bool, 2> output_mask);
std::tuple<Tensor, Tensor> sample_tokens_cuda(const Tensor& hidden, const Tensor& weight, const Tensor& row_ids,
                                              double temperature, int64_t seed, int64_t offset,
                                              at::IntArrayRef suppress_ids, at::IntArrayRef confidence_exclude_ids,
                                              int64_t chunk_size);
Tensor select_transfer_cuda(const Tensor& confidence, const Tensor& candidates, const Tensor& counts,
                            double threshold);
#endif

}  // namespace dllm_fast
