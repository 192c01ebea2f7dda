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
  TORCH_CHECK(hidden.size(1) > 0, "masked_logprobs: hidden has width d = 0; the model width must be positive.");
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

void check_masked_logprobs_grad_args(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                     const Tensor& grad_logp, const std::optional<Tensor>& lse,
                                     const std::optional<Tensor>& grad_weight, int64_t chunk_size) {
  check_masked_logprobs_args(hidden, weight, targets, chunk_size);
  const int64_t M = hidden.size(0);
  const auto acc = accumulate_type(hidden.scalar_type());
  TORCH_CHECK(grad_logp.dim() == 1 && grad_logp.size(0) == M && grad_logp.is_floating_point(),
              "masked_logprobs_grad: grad_logp must be a floating-point [M] tensor with M = ", M, ", got ",
              grad_logp.scalar_type(), " ", grad_logp.sizes(), ".");
  TORCH_CHECK(grad_logp.device() == hidden.device(), "masked_logprobs_grad: grad_logp is on ", grad_logp.device(),
              " but hidden on ", hidden.device(), "; move it to hidden's device.");
  if (lse.has_value() && lse->defined()) {
    TORCH_CHECK(lse->dim() == 1 && lse->size(0) == M && lse->scalar_type() == acc,
                "masked_logprobs_grad: lse must be a ", acc, " [M] tensor with M = ", M, ", got ", lse->scalar_type(),
                " ", lse->sizes(), ".");
    TORCH_CHECK(lse->device() == hidden.device(), "masked_logprobs_grad: lse is on ", lse->device(),
                " but hidden on ", hidden.device(), "; move it to hidden's device.");
  }
  if (grad_weight.has_value() && grad_weight->defined()) {
    TORCH_CHECK(grad_weight->sizes() == weight.sizes() && grad_weight->scalar_type() == weight.scalar_type() &&
                    grad_weight->device() == weight.device(),
                "masked_logprobs_grad: grad_weight must match weight (", weight.scalar_type(), " ", weight.sizes(),
                " on ", weight.device(), "), got ", grad_weight->scalar_type(), " ", grad_weight->sizes(), " on ",
                grad_weight->device(), ".");
    TORCH_CHECK(grad_weight->is_contiguous(), "masked_logprobs_grad: grad_weight must be contiguous (its rows are "
                "updated in place chunk by chunk); pass weight.grad of a contiguous parameter, or None.");
  }
}

void check_sample_tokens_args(const Tensor& hidden, const Tensor& weight, const Tensor& row_ids, double temperature,
                              at::IntArrayRef suppress_ids, at::IntArrayRef confidence_exclude_ids,
                              int64_t chunk_size) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "sample_tokens: hidden must be [N, d] and weight [V, d], got shapes ", hidden.sizes(), " and ",
              weight.sizes(), ".");
  TORCH_CHECK(hidden.size(1) > 0 && weight.size(0) > 0, "sample_tokens: hidden width d and vocabulary V must be "
              "positive, got d = ", hidden.size(1), " and V = ", weight.size(0), ".");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "sample_tokens: hidden is ", hidden.scalar_type(),
              " but weight is ", weight.scalar_type(), "; cast one so both share a dtype.");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "sample_tokens: unsupported dtype ", dtype, "; use float32, float64, bfloat16 or float16.");
  TORCH_CHECK(row_ids.dim() == 1 && row_ids.size(0) == hidden.size(0) && row_ids.scalar_type() == at::kLong,
              "sample_tokens: row_ids must be int64 [N] with N = ", hidden.size(0), ", got ", row_ids.scalar_type(),
              " ", row_ids.sizes(), ".");
  TORCH_CHECK(hidden.device() == weight.device() && hidden.device() == row_ids.device(),
              "sample_tokens: hidden, weight and row_ids must be on one device.");
  TORCH_CHECK(temperature >= 0.0, "sample_tokens: temperature must be >= 0, got ", temperature, ".");
  TORCH_CHECK(chunk_size > 0, "sample_tokens: chunk_size must be positive, got ", chunk_size, ".");
  for (const auto& ids : {suppress_ids, confidence_exclude_ids}) {
    for (const int64_t id : ids) {
      TORCH_CHECK(id >= 0 && id < weight.size(0), "sample_tokens: token id ", id, " is outside the vocabulary [0, ",
                  weight.size(0), ").");
    }
  }
}

void check_select_transfer_args(const Tensor& confidence, const Tensor& candidates, const Tensor& counts,
                                double threshold) {
  TORCH_CHECK(confidence.dim() == 2, "select_transfer: confidence must be [B, n], got ", confidence.sizes(), ".");
  TORCH_CHECK(confidence.scalar_type() == at::kFloat || confidence.scalar_type() == at::kDouble,
              "select_transfer: confidence must be float32 or float64, got ", confidence.scalar_type(), ".");
  TORCH_CHECK(candidates.sizes() == confidence.sizes() && candidates.scalar_type() == at::kBool,
              "select_transfer: candidates must be a bool tensor of confidence's shape ", confidence.sizes(), ".");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == confidence.size(0) && counts.scalar_type() == at::kLong,
              "select_transfer: counts must be int64 [B] with B = ", confidence.size(0), ".");
  TORCH_CHECK(confidence.device() == candidates.device() && confidence.device() == counts.device(),
              "select_transfer: confidence, candidates and counts must be on one device.");
  TORCH_CHECK(threshold <= 1.0, "select_transfer: threshold must be at most 1 (or negative for top-k), got ",
              threshold, ".");
}

}  // namespace dllm_fast
