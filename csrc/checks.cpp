// Argument checks shared by the CPU and CUDA kernels of each op. Messages name the value and the fix.

#include <c10/util/Exception.h>

#include "dllm_fast/ops.h"

namespace dllm_fast {

at::ScalarType accumulate_type(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

void check_masked_logprobs_args(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                int64_t chunk_size) {
  TORCH_CHECK(hidden.dim() == 2, "masked_logprobs: hidden must be 2-D [M, d], got shape ", hidden.sizes(),
              "; flatten the positions to score into rows first.");
  TORCH_CHECK(weight.dim() == 2, "masked_logprobs: weight must be 2-D [V, d], got shape ", weight.sizes(), ".");
  TORCH_CHECK(hidden.size(1) == weight.size(1), "masked_logprobs: hidden has d = ", hidden.size(1),
              " but weight has d = ", weight.size(1), "; both must share the model width.");
  TORCH_CHECK(weight.size(0) > 0, "masked_logprobs: weight has an empty vocabulary (V = 0).");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "masked_logprobs: targets must be 1-D [M] with M = ",
              hidden.size(0), " (the rows of hidden), got shape ", targets.sizes(), ".");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "masked_logprobs: targets must be int64, got ",
              targets.scalar_type(), "; call targets.long().");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "masked_logprobs: hidden is ", hidden.scalar_type(),
              " but weight is ", weight.scalar_type(), "; cast one so both share a dtype.");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "masked_logprobs: unsupported dtype ", dtype, "; use float32, float64, bfloat16 or float16.");
  TORCH_CHECK(hidden.device() == weight.device() && hidden.device() == targets.device(),
              "masked_logprobs: hidden, weight and targets must be on one device, got ", hidden.device(), ", ",
              weight.device(), " and ", targets.device(), ".");
  TORCH_CHECK(chunk_size > 0, "masked_logprobs: chunk_size must be positive, got ", chunk_size, ".");
}

}  // namespace dllm_fast
