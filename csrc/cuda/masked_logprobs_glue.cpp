// Torch glue of dllm_fast::masked_logprobs, its backward and masked_logprobs_grad on CUDA (compiled only in CUDA
// builds): device guard and stream, the per-chunk cuBLAS GEMMs, and the torch-free kernels of masked_logprobs.cu.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>

#include "blas.h"
#include "dllm_fast/ops.h"
#include "masked_logprobs.cuh"

namespace dllm_fast {
namespace {

constexpr const char* kOp = "masked_logprobs";

template <typename acc_t>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                                const at::Tensor& targets_in, int64_t chunk_size) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), targets = targets_in.contiguous();
  const int64_t M = hidden.size(0), d = hidden.size(1), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  at::Tensor logp = at::empty({M}, opts), lse = at::empty({M}, opts);
  if (M == 0) return {logp, lse};
  const int64_t C = std::min(chunk_size, V);
  at::Tensor logits = at::empty({M * C}, opts);
  at::Tensor run_max = at::full({M}, -std::numeric_limits<acc_t>::infinity(), opts);
  at::Tensor run_sum = at::zeros({M}, opts);
  at::Tensor target_logit = at::full({M}, std::numeric_limits<acc_t>::quiet_NaN(), opts);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    // logits[M, c] = hidden[M, d] @ weight[v0:v0+c, d]^T
    blas::gemm(kOp, false, true, M, c, d, hidden.data_ptr(), hidden.scalar_type(), d,
               blas::element_address(weight, v0 * d), weight.scalar_type(), d, logits.data_ptr(), acc, c, 1.0, 0.0);
    C10_CUDA_CHECK(cuda::launch_chunk_logsumexp<acc_t>(
        logits.data_ptr<acc_t>(), M, c, c, v0, targets.data_ptr<int64_t>(), run_max.data_ptr<acc_t>(),
        run_sum.data_ptr<acc_t>(), target_logit.data_ptr<acc_t>(), stream));
  }
  C10_CUDA_CHECK(cuda::launch_finalize_logprobs<acc_t>(M, run_max.data_ptr<acc_t>(), run_sum.data_ptr<acc_t>(),
                                                       target_logit.data_ptr<acc_t>(), lse.data_ptr<acc_t>(),
                                                       logp.data_ptr<acc_t>(), stream));
  return {logp, lse};
}

template <typename acc_t>
std::tuple<at::Tensor, at::Tensor> backward_impl(const std::optional<at::Tensor>& grad_logp,
                                                 const std::optional<at::Tensor>& grad_lse, const at::Tensor& hidden_in,
                                                 const at::Tensor& weight_in, const at::Tensor& targets_in,
                                                 const at::Tensor& lse_in, int64_t chunk_size,
                                                 std::array<bool, 2> output_mask) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), targets = targets_in.contiguous();
  const int64_t M = hidden.size(0), d = hidden.size(1), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto dtype = hidden.scalar_type();
  const auto opts = hidden.options().dtype(acc);
  const bool need_h = output_mask[0], need_w = output_mask[1];
  at::Tensor grad_h = need_h ? at::zeros({M, d}, opts) : at::Tensor();  // fp32 accumulator across chunks
  const bool has_glp = grad_logp.has_value() && grad_logp->defined();
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if ((!need_h && !need_w) || M == 0 || (!has_glp && !has_glse)) {
    return {need_h ? grad_h.to(dtype) : at::Tensor(), need_w ? at::zeros_like(weight) : at::Tensor()};
  }
  at::Tensor grad_w = need_w ? at::empty_like(weight) : at::Tensor();  // every chunk writes its rows
  // The log-prob of a target outside [0, V) is a constant NaN: nothing flows back through it (as on CPU).
  const at::Tensor glp =
      has_glp ? grad_logp->to(acc).masked_fill(targets.lt(0).logical_or_(targets.ge(V)), 0).contiguous() : at::Tensor();
  const at::Tensor glse = has_glse ? grad_lse->to(acc).contiguous() : at::Tensor();
  const at::Tensor lse = lse_in.to(acc).contiguous();
  const int64_t C = std::min(chunk_size, V);
  at::Tensor logits = at::empty({M * C}, opts);  // the chunk's logits, then in place its d(logits)
  // d(logits) stays in the accumulator type: in fp16 its small terms would underflow (below 6e-8). For bf16 and
  // fp16 models the backward GEMMs take acc-typed copies of the weight chunk and of hidden, in TF32, which holds
  // their values exactly; grad_w's chunk is computed in acc and rounded to the model's dtype once.
  const bool low_precision = dtype != acc;
  const auto precision = low_precision ? blas::Precision::kTF32 : blas::Precision::kExact;
  const at::Tensor hidden_acc = low_precision && need_w ? hidden.to(acc) : hidden;
  at::Tensor grad_w_chunk = low_precision && need_w ? at::empty({C, d}, opts) : at::Tensor();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const at::Tensor w_chunk = weight.narrow(0, v0, c);
    blas::gemm(kOp, false, true, M, c, d, hidden.data_ptr(), dtype, d, w_chunk.data_ptr(), dtype, d, logits.data_ptr(),
               acc, c, 1.0, 0.0);
    C10_CUDA_CHECK(cuda::launch_chunk_softmax_grad<acc_t>(
        logits.data_ptr<acc_t>(), M, c, c, v0, targets.data_ptr<int64_t>(), lse.data_ptr<acc_t>(),
        has_glp ? glp.data_ptr<acc_t>() : nullptr, has_glse ? glse.data_ptr<acc_t>() : nullptr, stream));
    const at::Tensor w_acc = low_precision && need_h ? w_chunk.to(acc) : w_chunk;
    if (need_h) {  // grad_h[M, d] += dlogits[M, c] @ weight[v0:v0+c, d]
      blas::gemm(kOp, false, false, M, d, c, logits.data_ptr(), acc, c, w_acc.data_ptr(), acc, d, grad_h.data_ptr(),
                 acc, d, 1.0, 1.0, precision);
    }
    if (need_w) {  // grad_w[v0:v0+c, d] = dlogits[M, c]^T @ hidden[M, d]
      void* out = low_precision ? grad_w_chunk.data_ptr() : blas::element_address(grad_w, v0 * d);
      blas::gemm(kOp, true, false, c, d, M, logits.data_ptr(), acc, c, hidden_acc.data_ptr(), acc, d, out, acc, d,
                 1.0, 0.0, precision);
      if (low_precision) grad_w.narrow(0, v0, c).copy_(grad_w_chunk.narrow(0, 0, c));
    }
  }
  return {need_h ? grad_h.to(dtype) : at::Tensor(), grad_w};
}

// The gradients of sum_i g_i * logp_i for a known g, as the CPU kernel computes them (csrc/cpu/masked_logprobs.cpp
// grad_impl): one walk, three GEMMs per chunk, grad_weight's rows added straight into the caller's buffer
// (beta = 1) when it holds the accumulator type; a bf16/fp16 buffer gets each chunk's fp32 sum, rounded once,
// through one chunk-sized temporary. Never a [V, d] temporary.
template <typename acc_t>
std::tuple<at::Tensor, at::Tensor> grad_impl(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                             const at::Tensor& targets_in, const at::Tensor& grad_logp,
                                             const std::optional<at::Tensor>& lse_in,
                                             const std::optional<at::Tensor>& grad_weight_in, int64_t chunk_size) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), targets = targets_in.contiguous();
  const int64_t M = hidden.size(0), d = hidden.size(1), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto dtype = hidden.scalar_type();
  const auto opts = hidden.options().dtype(acc);
  at::Tensor logp = at::empty({M}, opts);
  if (M == 0) return {logp, at::zeros({M, d}, hidden.options())};
  const bool need_w = grad_weight_in.has_value() && grad_weight_in->defined();
  at::Tensor grad_weight = need_w ? *grad_weight_in : at::Tensor();  // the caller's buffer, contiguous (face)
  // A target outside [0, V) is never found (logp stays NaN) and passes no gradient back, as on CPU.
  const at::Tensor g = grad_logp.to(acc).masked_fill(targets.lt(0).logical_or_(targets.ge(V)), 0).contiguous();
  const bool has_lse = lse_in.has_value() && lse_in->defined();
  const at::Tensor lse = has_lse ? lse_in->to(acc).contiguous()
                                 : std::get<1>(forward_impl<acc_t>(hidden, weight, targets, chunk_size));
  const int64_t C = std::min(chunk_size, V);
  at::Tensor logits = at::empty({M * C}, opts);  // the chunk's logits, then in place its d(logits)
  at::Tensor grad_h = at::zeros({M, d}, opts);
  at::Tensor sum_e = at::zeros({M}, opts);
  at::Tensor target_logit = at::full({M}, std::numeric_limits<acc_t>::quiet_NaN(), opts);
  // As in backward_impl: d(logits) stays in acc_t; bf16/fp16 models give the gradient GEMMs acc-typed copies of
  // hidden and of the weight chunk, in TF32, which holds their values exactly.
  const bool low_precision = dtype != acc;
  const auto precision = low_precision ? blas::Precision::kTF32 : blas::Precision::kExact;
  const at::Tensor hidden_acc = low_precision ? hidden.to(acc) : hidden;
  const bool accumulate_in_place = need_w && grad_weight.scalar_type() == acc;
  at::Tensor grad_w_chunk = need_w && !accumulate_in_place ? at::empty({C, d}, opts) : at::Tensor();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const at::Tensor w_chunk = weight.narrow(0, v0, c);
    blas::gemm(kOp, false, true, M, c, d, hidden.data_ptr(), dtype, d, w_chunk.data_ptr(), dtype, d, logits.data_ptr(),
               acc, c, 1.0, 0.0);
    C10_CUDA_CHECK(cuda::launch_chunk_known_grad<acc_t>(logits.data_ptr<acc_t>(), M, c, c, v0,
                                                        targets.data_ptr<int64_t>(), lse.data_ptr<acc_t>(),
                                                        g.data_ptr<acc_t>(), sum_e.data_ptr<acc_t>(),
                                                        target_logit.data_ptr<acc_t>(), stream));
    const at::Tensor w_acc = low_precision ? w_chunk.to(acc) : w_chunk;
    // grad_h[M, d] += dlogits[M, c] @ weight[v0:v0+c, d]
    blas::gemm(kOp, false, false, M, d, c, logits.data_ptr(), acc, c, w_acc.data_ptr(), acc, d, grad_h.data_ptr(), acc,
               d, 1.0, 1.0, precision);
    if (need_w) {  // grad_weight[v0:v0+c, d] += dlogits[M, c]^T @ hidden[M, d]
      if (accumulate_in_place) {
        blas::gemm(kOp, true, false, c, d, M, logits.data_ptr(), acc, c, hidden_acc.data_ptr(), acc, d,
                   blas::element_address(grad_weight, v0 * d), acc, d, 1.0, 1.0, precision);
      } else {
        blas::gemm(kOp, true, false, c, d, M, logits.data_ptr(), acc, c, hidden_acc.data_ptr(), acc, d,
                   grad_w_chunk.data_ptr(), acc, d, 1.0, 0.0, precision);
        grad_weight.narrow(0, v0, c).add_(grad_w_chunk.narrow(0, 0, c));
      }
    }
  }
  // g = 0 for a target outside [0, V): its clamped row is multiplied by 0.
  const at::Tensor target_rows = weight.index_select(0, targets.clamp(0, V - 1)).to(acc).contiguous();
  C10_CUDA_CHECK(cuda::launch_finalize_known_grad<acc_t>(M, d, sum_e.data_ptr<acc_t>(), target_logit.data_ptr<acc_t>(),
                                                         lse.data_ptr<acc_t>(), g.data_ptr<acc_t>(),
                                                         target_rows.data_ptr<acc_t>(), grad_h.data_ptr<acc_t>(),
                                                         logp.data_ptr<acc_t>(), stream));
  return {logp, grad_h.to(dtype)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> masked_logprobs_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                        const at::Tensor& targets, int64_t chunk_size) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return forward_impl<decltype(acc)>(hidden, weight, targets, chunk_size);
  });
}

std::tuple<at::Tensor, at::Tensor> masked_logprobs_backward_cuda(
    const std::optional<at::Tensor>& grad_logp, const std::optional<at::Tensor>& grad_lse, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse, int64_t chunk_size,
    std::array<bool, 2> output_mask) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return backward_impl<decltype(acc)>(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask);
  });
}

std::tuple<at::Tensor, at::Tensor> masked_logprobs_grad_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                             const at::Tensor& targets, const at::Tensor& grad_logp,
                                                             const std::optional<at::Tensor>& lse,
                                                             const std::optional<at::Tensor>& grad_weight,
                                                             int64_t chunk_size) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return grad_impl<decltype(acc)>(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size);
  });
}

}  // namespace dllm_fast
