// Torch glue of dllm_fast::masked_logprobs, its backward and masked_logprobs_grad on CUDA (compiled only in CUDA
// builds): device guard and stream, the walk over the vocabulary chunks with its cuBLAS GEMMs, and the torch-free
// kernels of masked_logprobs.cu.
//
// The GEMMs' types. The logits GEMM takes hidden and the weight chunk as they are and accumulates in fp32 (fp64
// for fp64 inputs). The two gradient GEMMs of a bf16/fp16 model take d(logits) computed in fp32 and rounded once
// to the model's dtype, with hidden and the weight chunk as they are (no copies), and accumulate in fp32:
// grad_hidden across all chunks in an fp32 buffer (beta = 1), grad_weight's rows in fp32, rounded once into a
// bf16/fp16 gradient through one chunk-sized fp32 temporary. fp16, whose exponent cannot hold a softmax's
// tail, first scales d(logits) by a power of two from the largest upstream gradient (gradient_scale.h), and
// the fp32 results are divided by it again: both exact. fp32 and fp64 inputs run exact GEMMs in their own
// type. tf32_grad_gemms (the schemas' option) keeps d(logits) in fp32 and gives the gradient GEMMs fp32 operands
// in TF32, bf16/fp16 hidden and weight chunks through fp32 copies: the path before issue 28, half bf16's
// tensor-core rate and twice its bytes.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>

#include "blas.h"
#include "dllm_fast/gradient_scale.h"
#include "dllm_fast/ops.h"
#include "masked_logprobs.cuh"

namespace dllm_fast {
namespace {

constexpr const char* kOp = "masked_logprobs";

// What a walk computes besides each chunk's kernel: grad_hidden [M, d] in the accumulator type, accumulated
// over the chunks; grad_weight [V, d] (the model's dtype or the accumulator type), each chunk's rows written,
// or added into when add_into_weight. Undefined tensors are not computed.
struct WalkOutputs {
  at::Tensor grad_hidden;
  at::Tensor grad_weight;
  bool add_into_weight = false;
};

// The one walk over the vocabulary chunks of the forward, the backward and the known-gradient walk. Per chunk:
// logits[M, c] = hidden @ weight[v0:v0+c]^T; chunk_step(v0, c, logits, grad) launches the chunk's kernel
// (returning its cudaError_t), which writes d(logits) into `grad` (a cuda::GradOutput) when the walk has
// outputs; then grad_hidden += d(logits) @ weight chunk and grad_weight's rows (+)= d(logits)^T @ hidden.
// upstream_bound: [M] bounds on each row's |d(logits)|, read for fp16 only (undefined for the forward).
template <typename acc_t, typename ChunkStep>
void walk_vocabulary(const at::Tensor& hidden, const at::Tensor& weight, int64_t chunk_size, bool tf32_grad_gemms,
                     const at::Tensor& upstream_bound, WalkOutputs& out, ChunkStep&& chunk_step) {
  const int64_t M = hidden.size(0), d = hidden.size(1), V = weight.size(0), C = std::min(chunk_size, V);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto dtype = hidden.scalar_type();
  const auto acc_opts = hidden.options().dtype(acc);
  const bool need_h = out.grad_hidden.defined(), need_w = out.grad_weight.defined();
  // The gradient GEMMs' operand type: the model's dtype, or the accumulator type under the option.
  const bool tf32 = tf32_grad_gemms && acc == at::kFloat;
  const auto operand = tf32 ? acc : dtype;
  const auto precision = tf32 ? blas::Precision::kTF32 : blas::Precision::kExact;
  const auto grad_type = operand == acc ? cuda::GradType::kAccumulate
                         : operand == at::kBFloat16 ? cuda::GradType::kBFloat16 : cuda::GradType::kHalf;
  at::Tensor logits = at::empty({M * C}, acc_opts);
  // d(logits): over the logits in place when it is in the accumulator type, else its own model-dtype buffer.
  at::Tensor grad = (need_h || need_w) && operand != acc ? at::empty({M * C}, hidden.options()) : logits;
  const at::Tensor hidden_operand = need_w && operand != dtype ? hidden.to(operand) : hidden;  // option only
  const bool weight_rows_direct = need_w && out.grad_weight.scalar_type() == acc;
  at::Tensor weight_rows = need_w && !weight_rows_direct ? at::empty({C, d}, acc_opts) : at::Tensor();
  const at::Tensor scale =
      (need_h || need_w) && grad_type == cuda::GradType::kHalf ? fp16_gradient_scale(upstream_bound) : at::Tensor();
  const cuda::GradOutput grad_output{grad.data_ptr(), grad_type, scale.defined() ? scale.data_ptr<float>() : nullptr};
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const at::Tensor w_chunk = weight.narrow(0, v0, c);
    blas::gemm(kOp, false, true, M, c, d, hidden.data_ptr(), dtype, d, w_chunk.data_ptr(), dtype, d,
               logits.data_ptr(), acc, c, 1.0, 0.0);
    C10_CUDA_CHECK(chunk_step(v0, c, logits.data_ptr<acc_t>(), grad_output));
    if (need_h) {  // grad_hidden[M, d] += d(logits)[M, c] @ weight[v0:v0+c, d]
      const at::Tensor w_operand = operand != dtype ? w_chunk.to(operand) : w_chunk;  // option only
      blas::gemm(kOp, false, false, M, d, c, grad.data_ptr(), operand, c, w_operand.data_ptr(), operand, d,
                 out.grad_hidden.data_ptr(), acc, d, 1.0, 1.0, precision);
    }
    if (need_w) {  // grad_weight[v0:v0+c, d] (+)= d(logits)[M, c]^T @ hidden[M, d]
      void* rows = weight_rows_direct ? blas::element_address(out.grad_weight, v0 * d) : weight_rows.data_ptr();
      const double beta = weight_rows_direct && out.add_into_weight ? 1.0 : 0.0;
      blas::gemm(kOp, true, false, c, d, M, grad.data_ptr(), operand, c, hidden_operand.data_ptr(), operand, d, rows,
                 acc, d, 1.0, beta, precision);
      if (!weight_rows_direct) {  // the chunk's fp32 sum, rounded once into the model-dtype gradient
        at::Tensor target = out.grad_weight.narrow(0, v0, c);
        at::Tensor chunk = weight_rows.narrow(0, 0, c);
        if (scale.defined()) chunk.div_(scale);
        if (out.add_into_weight) {
          target.add_(chunk);
        } else {
          target.copy_(chunk);
        }
      }
    }
  }
  if (scale.defined() && need_h) out.grad_hidden.div_(scale);
}

template <typename acc_t>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                                const at::Tensor& targets_in, int64_t chunk_size) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), targets = targets_in.contiguous();
  const int64_t M = hidden.size(0);
  const auto opts = hidden.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  at::Tensor logp = at::empty({M}, opts), lse = at::empty({M}, opts);
  if (M == 0) return {logp, lse};
  at::Tensor run_max = at::full({M}, -std::numeric_limits<acc_t>::infinity(), opts);
  at::Tensor run_sum = at::zeros({M}, opts);
  at::Tensor target_logit = at::full({M}, std::numeric_limits<acc_t>::quiet_NaN(), opts);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  WalkOutputs none;
  walk_vocabulary<acc_t>(hidden, weight, chunk_size, false, at::Tensor(), none,
                         [&](int64_t v0, int64_t c, const acc_t* logits, cuda::GradOutput) {
                           return cuda::launch_chunk_logsumexp<acc_t>(
                               logits, M, c, c, v0, targets.data_ptr<int64_t>(), run_max.data_ptr<acc_t>(),
                               run_sum.data_ptr<acc_t>(), target_logit.data_ptr<acc_t>(), stream);
                         });
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
                                                 std::array<bool, 2> output_mask, bool tf32_grad_gemms) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), targets = targets_in.contiguous();
  const int64_t M = hidden.size(0), d = hidden.size(1), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto dtype = hidden.scalar_type();
  const bool need_h = output_mask[0], need_w = output_mask[1];
  WalkOutputs out;
  if (need_h) out.grad_hidden = at::zeros({M, d}, hidden.options().dtype(acc));  // accumulated across chunks
  const bool has_glp = grad_logp.has_value() && grad_logp->defined();
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if ((!need_h && !need_w) || M == 0 || (!has_glp && !has_glse)) {
    return {need_h ? out.grad_hidden.to(dtype) : at::Tensor(), need_w ? at::zeros_like(weight) : at::Tensor()};
  }
  if (need_w) out.grad_weight = at::empty_like(weight);  // every chunk writes its rows
  // The log-prob of a target outside [0, V) is a constant NaN: nothing flows back through it (as on CPU).
  const at::Tensor glp =
      has_glp ? grad_logp->to(acc).masked_fill(targets.lt(0).logical_or_(targets.ge(V)), 0).contiguous() : at::Tensor();
  const at::Tensor glse = has_glse ? grad_lse->to(acc).contiguous() : at::Tensor();
  const at::Tensor lse = lse_in.to(acc).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor bound = dtype == at::kHalf ? softmax_grad_bound(glp, glse) : at::Tensor();  // fp16 only
  walk_vocabulary<acc_t>(hidden, weight, chunk_size, tf32_grad_gemms, bound, out,
                         [&](int64_t v0, int64_t c, const acc_t* logits, cuda::GradOutput grad) {
                           return cuda::launch_chunk_softmax_grad<acc_t>(
                               logits, grad, M, c, c, v0, targets.data_ptr<int64_t>(),
                               lse.data_ptr<acc_t>(), has_glp ? glp.data_ptr<acc_t>() : nullptr,
                               has_glse ? glse.data_ptr<acc_t>() : nullptr, stream);
                         });
  return {need_h ? out.grad_hidden.to(dtype) : at::Tensor(), out.grad_weight};
}

// The gradients of sum_i g_i * logp_i for a known g, as the CPU kernel computes them (csrc/cpu/masked_logprobs.cpp
// grad_impl): one walk, three GEMMs per chunk, grad_weight's rows added straight into the caller's buffer
// (beta = 1) when it holds the accumulator type; a bf16/fp16 buffer gets each chunk's fp32 sum, rounded once,
// through one chunk-sized temporary. Never a [V, d] temporary.
template <typename acc_t>
std::tuple<at::Tensor, at::Tensor> grad_impl(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                             const at::Tensor& targets_in, const at::Tensor& grad_logp,
                                             const std::optional<at::Tensor>& lse_in,
                                             const std::optional<at::Tensor>& grad_weight, int64_t chunk_size,
                                             bool tf32_grad_gemms) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), targets = targets_in.contiguous();
  const int64_t M = hidden.size(0), d = hidden.size(1), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  at::Tensor logp = at::empty({M}, opts);
  if (M == 0) return {logp, at::zeros({M, d}, hidden.options())};
  WalkOutputs out;
  out.grad_hidden = at::zeros({M, d}, opts);
  if (grad_weight.has_value() && grad_weight->defined()) out.grad_weight = *grad_weight;  // contiguous (face)
  out.add_into_weight = true;
  // A target outside [0, V) is never found (logp stays NaN) and passes no gradient back, as on CPU.
  const at::Tensor g = grad_logp.to(acc).masked_fill(targets.lt(0).logical_or_(targets.ge(V)), 0).contiguous();
  const bool has_lse = lse_in.has_value() && lse_in->defined();
  const at::Tensor lse = has_lse ? lse_in->to(acc).contiguous()
                                 : std::get<1>(forward_impl<acc_t>(hidden, weight, targets, chunk_size));
  at::Tensor sum_e = at::zeros({M}, opts);
  at::Tensor target_logit = at::full({M}, std::numeric_limits<acc_t>::quiet_NaN(), opts);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // |d(logits)| = |g (onehot - e)| <= |g| (e <= 1 for an exact lse; fp16's headroom covers one a little low)
  walk_vocabulary<acc_t>(hidden, weight, chunk_size, tf32_grad_gemms, g, out,
                         [&](int64_t v0, int64_t c, const acc_t* logits, cuda::GradOutput grad) {
                           return cuda::launch_chunk_known_grad<acc_t>(
                               logits, grad, M, c, c, v0, targets.data_ptr<int64_t>(),
                               lse.data_ptr<acc_t>(), g.data_ptr<acc_t>(), sum_e.data_ptr<acc_t>(),
                               target_logit.data_ptr<acc_t>(), stream);
                         });
  // g = 0 for a target outside [0, V): its clamped row is multiplied by 0.
  const at::Tensor target_rows = weight.index_select(0, targets.clamp(0, V - 1)).to(acc).contiguous();
  C10_CUDA_CHECK(cuda::launch_finalize_known_grad<acc_t>(M, d, sum_e.data_ptr<acc_t>(), target_logit.data_ptr<acc_t>(),
                                                         lse.data_ptr<acc_t>(), g.data_ptr<acc_t>(),
                                                         target_rows.data_ptr<acc_t>(),
                                                         out.grad_hidden.data_ptr<acc_t>(), logp.data_ptr<acc_t>(),
                                                         stream));
  return {logp, out.grad_hidden.to(hidden.scalar_type())};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> masked_logprobs_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                        const at::Tensor& targets, int64_t chunk_size,
                                                        bool /*tf32_grad_gemms: its backward's*/) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return forward_impl<decltype(acc)>(hidden, weight, targets, chunk_size);
  });
}

std::tuple<at::Tensor, at::Tensor> masked_logprobs_backward_cuda(
    const std::optional<at::Tensor>& grad_logp, const std::optional<at::Tensor>& grad_lse, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse, int64_t chunk_size,
    std::array<bool, 2> output_mask, bool tf32_grad_gemms) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return backward_impl<decltype(acc)>(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask,
                                        tf32_grad_gemms);
  });
}

std::tuple<at::Tensor, at::Tensor> masked_logprobs_grad_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                             const at::Tensor& targets, const at::Tensor& grad_logp,
                                                             const std::optional<at::Tensor>& lse,
                                                             const std::optional<at::Tensor>& grad_weight,
                                                             int64_t chunk_size, bool tf32_grad_gemms) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return grad_impl<decltype(acc)>(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                                    tf32_grad_gemms);
  });
}

}  // namespace dllm_fast
