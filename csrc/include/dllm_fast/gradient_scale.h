// The power of two that fp16 d(logits) are multiplied by before they are rounded to fp16 for the gradient GEMMs,
// shared by the CPU kernel and the CUDA glue (torch side). fp16's exponent cannot hold a softmax's tail: times a
// small upstream gradient, most of d(logits) would fall among its subnormals or flush to zero. The scale is
// 2**12 over the largest bound on a row's |d(logits)|: it leaves 2**4 of headroom below fp16's largest value
// (for masked_logprobs_grad's e = exp(logit - lse), which exceeds 1 when the given lse is too low; more than
// log 16 too low overflows) and keeps every entry above 2**-36 times that bound, at full precision above 2**-26.
// Multiplying by it before rounding and dividing the GEMMs' fp32 results by it again are exact. Computed with
// tensor ops on the bounds' device: no host sync on CUDA.
#pragma once

#include <ATen/ATen.h>

namespace dllm_fast {

// row_bounds: [M] bounds on each row's |d(logits)|. Returns a [1] float tensor on their device.
inline at::Tensor fp16_gradient_scale(const at::Tensor& row_bounds) {
  const at::Tensor largest = row_bounds.abs().max().to(at::kFloat).clamp_min(1e-30f);
  return at::exp2(at::floor(at::log2(largest.reciprocal().mul_(4096.0f)))).clamp_(0x1p-60f, 0x1p60f).reshape({1});
}

// The backward's bound: |(g_lse - g_logp) p + g_logp onehot| <= |g_lse - g_logp| + |g_logp|. Either gradient may
// be undefined (zero), not both.
inline at::Tensor softmax_grad_bound(const at::Tensor& grad_logp, const at::Tensor& grad_lse) {
  if (!grad_logp.defined()) return grad_lse.abs();
  if (!grad_lse.defined()) return grad_logp.abs();
  return grad_lse.sub(grad_logp).abs_().add_(grad_logp.abs());
}

}  // namespace dllm_fast
