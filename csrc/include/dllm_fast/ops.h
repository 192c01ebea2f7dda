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

// dtype of logp / lse / the fp32-or-fp64 accumulators for a given input dtype.
at::ScalarType accumulate_type(at::ScalarType input);

std::tuple<Tensor, Tensor> masked_logprobs_cpu(const Tensor& hidden, const Tensor& weight,
                                               const Tensor& targets, int64_t chunk_size);
std::tuple<Tensor, Tensor> masked_logprobs_backward_cpu(
    const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_lse, const Tensor& hidden,
    const Tensor& weight, const Tensor& targets, const Tensor& lse, int64_t chunk_size,
    std::array<bool, 2> output_mask);

#ifdef DLLM_FAST_WITH_CUDA
std::tuple<Tensor, Tensor> masked_logprobs_cuda(const Tensor& hidden, const Tensor& weight,
                                                const Tensor& targets, int64_t chunk_size);
std::tuple<Tensor, Tensor> masked_logprobs_backward_cuda(
    const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_lse, const Tensor& hidden,
    const Tensor& weight, const Tensor& targets, const Tensor& lse, int64_t chunk_size,
    std::array<bool, 2> output_mask);
#endif

}  // namespace dllm_fast
