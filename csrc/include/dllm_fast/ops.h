// Declarations of every backend implementation that csrc/registration.cpp registers.
// The schemas themselves (and their documentation) live in dllm_fast/schemas.h.
#pragma once

#include <array>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace dllm_fast {

using at::Tensor;

// The ops trust their arguments: dllm_fast/ops/ (the Python faces) checks shapes, dtypes, devices and values
// once, for every backend, and names the offending value. A direct torch.ops.dllm_fast call skips those checks.

// dtype of logp / lse / the fp32-or-fp64 accumulators for a given input dtype.
inline at::ScalarType accumulate_type(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

// The one float/double dispatch of every backend: calls fn with a value of the accumulator type of `input`
// (double for float64, float for float32, bfloat16 and float16) and returns what it returns:
//   return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) { return impl<decltype(acc)>(...); });
template <typename Fn>
auto dispatch_accumulate(at::ScalarType input, Fn&& fn) {
  if (accumulate_type(input) == at::kDouble) return fn(double{});
  return fn(float{});
}

// Every backend implements the same signatures, those of the schemas (dllm_fast/schemas.h), named
// <op>_<backend>: declared once here for each backend.
#define DLLM_FAST_DECLARE_KERNELS(backend)                                                                         \
  std::tuple<Tensor, Tensor> masked_logprobs_##backend(const Tensor& hidden, const Tensor& weight,                 \
                                                       const Tensor& targets, int64_t chunk_size,                  \
                                                       bool tf32_grad_gemms);                                      \
  std::tuple<Tensor, Tensor> masked_logprobs_backward_##backend(                                                   \
      const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_lse, const Tensor& hidden,         \
      const Tensor& weight, const Tensor& targets, const Tensor& lse, int64_t chunk_size,                          \
      std::array<bool, 2> output_mask, bool tf32_grad_gemms);                                                      \
  std::tuple<Tensor, Tensor> masked_logprobs_grad_##backend(                                                       \
      const Tensor& hidden, const Tensor& weight, const Tensor& targets, const Tensor& grad_logp,                  \
      const std::optional<Tensor>& lse, const std::optional<Tensor>& grad_weight, int64_t chunk_size,              \
      bool tf32_grad_gemms);                                                                                       \
  std::tuple<Tensor, Tensor> sample_tokens_##backend(                                                              \
      const Tensor& hidden, const Tensor& weight, const Tensor& row_ids, double temperature, int64_t seed,         \
      int64_t offset, at::IntArrayRef suppress_ids, at::IntArrayRef confidence_exclude_ids, int64_t chunk_size);   \
  Tensor select_transfer_##backend(const Tensor& confidence, const Tensor& candidates, const Tensor& counts,        \
                                   double threshold);                                                              \
  Tensor rope_##backend(const Tensor& x, const Tensor& tables, int64_t rotated_heads);

DLLM_FAST_DECLARE_KERNELS(cpu)
#ifdef DLLM_FAST_WITH_CUDA
DLLM_FAST_DECLARE_KERNELS(cuda)
#endif
#undef DLLM_FAST_DECLARE_KERNELS

}  // namespace dllm_fast
