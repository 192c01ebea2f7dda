// Torch glue for the CUDA kernels (compiled only in CUDA builds): argument checks, stream and device guard,
// the per-chunk cuBLAS GEMMs, and the torch-free launchers of masked_logprobs.cu.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <limits>

#include "dllm_fast/ops.h"
#include "masked_logprobs.cuh"
#include "sampling.cuh"

namespace dllm_fast {
namespace {

using cuda::ScalarKind;

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kDouble: return CUDA_R_64F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: TORCH_CHECK(false, "masked_logprobs: unsupported dtype ", t);
  }
}

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::kFloat32;
    case at::kDouble: return ScalarKind::kFloat64;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kHalf: return ScalarKind::kFloat16;
    default: TORCH_CHECK(false, "masked_logprobs: unsupported dtype ", t);
  }
}

int to_int(int64_t v, const char* what) {
  TORCH_CHECK(v <= INT_MAX, "masked_logprobs: ", what, " = ", v, " exceeds cuBLAS's 32-bit sizes.");
  return static_cast<int>(v);
}

// Row-major C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C, with lda/ldb/ldc the row lengths as
// stored. cuBLAS is column-major, where a row-major X is X^T, so it computes C^T = op(B)^T @ op(A)^T.
// Products accumulate in fp32 (fp64 for fp64 outputs) whatever the input type.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A, at::ScalarType a_type,
          int64_t lda, const void* B, at::ScalarType b_type, int64_t ldb, void* C, at::ScalarType c_type,
          int64_t ldc, double alpha, double beta) {
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const bool wide = c_type == at::kDouble;
  const cublasComputeType_t compute = wide ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  const void* alpha_p = wide ? static_cast<const void*>(&alpha) : static_cast<const void*>(&alpha_f);
  const void* beta_p = wide ? static_cast<const void*>(&beta) : static_cast<const void*>(&beta_f);
  const cublasStatus_t status = cublasGemmEx(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, to_int(n, "n"),
      to_int(m, "m"), to_int(k, "k"), alpha_p, B, cuda_type(b_type), to_int(ldb, "ldb"), A, cuda_type(a_type),
      to_int(lda, "lda"), beta_p, C, cuda_type(c_type), to_int(ldc, "ldc"), compute, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "masked_logprobs: cublasGemmEx failed with status ",
              static_cast<int>(status), ".");
}

const char* byte_offset(const at::Tensor& t, int64_t elements) {
  return static_cast<const char*>(t.data_ptr()) + elements * t.element_size();
}

char* byte_offset_mut(at::Tensor& t, int64_t elements) {
  return static_cast<char*>(t.data_ptr()) + elements * t.element_size();
}

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
    gemm(false, true, M, c, d, hidden.data_ptr(), hidden.scalar_type(), d, byte_offset(weight, v0 * d),
         weight.scalar_type(), d, logits.data_ptr(), acc, c, 1.0, 0.0);
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
  const at::Tensor glp = has_glp ? grad_logp->to(acc).contiguous() : at::Tensor();
  const at::Tensor glse = has_glse ? grad_lse->to(acc).contiguous() : at::Tensor();
  const at::Tensor lse = lse_in.to(acc).contiguous();
  const int64_t C = std::min(chunk_size, V);
  at::Tensor logits = at::empty({M * C}, opts);
  // The backward GEMMs read d(logits) in the model's dtype (tensor cores for bf16/fp16); fp32/fp64 reuse logits.
  at::Tensor dlogits = dtype == acc ? logits : at::empty({M * C}, hidden.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const void* w_chunk = byte_offset(weight, v0 * d);
    gemm(false, true, M, c, d, hidden.data_ptr(), dtype, d, w_chunk, dtype, d, logits.data_ptr(), acc, c, 1.0, 0.0);
    C10_CUDA_CHECK(cuda::launch_chunk_softmax_grad<acc_t>(
        logits.data_ptr<acc_t>(), M, c, c, v0, targets.data_ptr<int64_t>(), lse.data_ptr<acc_t>(),
        has_glp ? glp.data_ptr<acc_t>() : nullptr, has_glse ? glse.data_ptr<acc_t>() : nullptr,
        dlogits.data_ptr(), scalar_kind(dtype), c, stream));
    if (need_h) {  // grad_h[M, d] += dlogits[M, c] @ weight[v0:v0+c, d]
      gemm(false, false, M, d, c, dlogits.data_ptr(), dtype, c, w_chunk, dtype, d, grad_h.data_ptr(), acc, d,
           1.0, 1.0);
    }
    if (need_w) {  // grad_w[v0:v0+c, d] = dlogits[M, c]^T @ hidden[M, d]
      gemm(true, false, c, d, M, dlogits.data_ptr(), dtype, c, hidden.data_ptr(), dtype, d,
           byte_offset_mut(grad_w, v0 * d), dtype, d, 1.0, 0.0);
    }
  }
  return {need_h ? grad_h.to(dtype) : at::Tensor(), grad_w};
}

cuda::TokenList token_list(at::IntArrayRef ids, const char* what) {
  TORCH_CHECK(static_cast<int64_t>(ids.size()) <= cuda::TokenList::kCapacity, "sample_tokens: at most ",
              cuda::TokenList::kCapacity, " ", what, " on CUDA, got ", ids.size(), ".");
  cuda::TokenList list{};
  list.count = static_cast<int>(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) list.ids[i] = ids[i];
  return list;
}

template <typename acc_t>
std::tuple<at::Tensor, at::Tensor> sample_impl(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                               const at::Tensor& row_ids_in, double temperature, int64_t seed,
                                               int64_t offset, at::IntArrayRef suppress_ids,
                                               at::IntArrayRef exclude_ids, int64_t chunk_size) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), row_ids = row_ids_in.contiguous();
  const int64_t N = hidden.size(0), d = hidden.size(1), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  at::Tensor tokens = at::empty({N}, hidden.options().dtype(at::kLong));
  at::Tensor confidence = at::empty({N}, opts);
  if (N == 0) return {tokens, confidence};
  const cuda::TokenList suppress = token_list(suppress_ids, "suppressed ids");
  const cuda::TokenList exclude = token_list(exclude_ids, "confidence-excluded ids");
  const int64_t C = std::min((chunk_size + 3) / 4 * 4, (V + 3) / 4 * 4);  // chunks start at multiples of 4
  at::Tensor logits = at::empty({N * C}, opts);
  at::Tensor best_score = at::full({N}, -std::numeric_limits<acc_t>::infinity(), opts);
  at::Tensor best_token = at::full({N}, -1, hidden.options().dtype(at::kLong));
  at::Tensor best_logit = at::zeros({N}, opts);
  at::Tensor run_max = at::full({N}, -std::numeric_limits<acc_t>::infinity(), opts);
  at::Tensor run_sum = at::zeros({N}, opts);
  const cuda::SampleState<acc_t> state{best_score.data_ptr<acc_t>(), best_token.data_ptr<int64_t>(),
                                       best_logit.data_ptr<acc_t>(), run_max.data_ptr<acc_t>(),
                                       run_sum.data_ptr<acc_t>()};
  const bool greedy = temperature == 0.0;
  const acc_t inv_temperature = greedy ? acc_t(1) : static_cast<acc_t>(1.0 / temperature);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    gemm(false, true, N, c, d, hidden.data_ptr(), hidden.scalar_type(), d, byte_offset(weight, v0 * d),
         weight.scalar_type(), d, logits.data_ptr(), acc, c, 1.0, 0.0);
    C10_CUDA_CHECK(cuda::launch_sample_chunk<acc_t>(logits.data_ptr<acc_t>(), N, c, c, v0, row_ids.data_ptr<int64_t>(),
                                                    greedy, inv_temperature, static_cast<uint64_t>(seed),
                                                    static_cast<uint32_t>(offset), suppress, exclude, state, stream));
  }
  C10_CUDA_CHECK(cuda::launch_sample_finalize<acc_t>(N, exclude, state, tokens.data_ptr<int64_t>(),
                                                     confidence.data_ptr<acc_t>(), stream));
  return {tokens, confidence};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sample_tokens_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                      const at::Tensor& row_ids, double temperature, int64_t seed,
                                                      int64_t offset, at::IntArrayRef suppress_ids,
                                                      at::IntArrayRef confidence_exclude_ids, int64_t chunk_size) {
  check_sample_tokens_args(hidden, weight, row_ids, temperature, suppress_ids, confidence_exclude_ids, chunk_size);
  const c10::cuda::CUDAGuard guard(hidden.device());
  if (accumulate_type(hidden.scalar_type()) == at::kDouble) {
    return sample_impl<double>(hidden, weight, row_ids, temperature, seed, offset, suppress_ids,
                               confidence_exclude_ids, chunk_size);
  }
  return sample_impl<float>(hidden, weight, row_ids, temperature, seed, offset, suppress_ids, confidence_exclude_ids,
                            chunk_size);
}

at::Tensor select_transfer_cuda(const at::Tensor& confidence_in, const at::Tensor& candidates_in,
                                const at::Tensor& counts_in, double threshold) {
  check_select_transfer_args(confidence_in, candidates_in, counts_in, threshold);
  const c10::cuda::CUDAGuard guard(confidence_in.device());
  const at::Tensor confidence = confidence_in.contiguous(), candidates = candidates_in.contiguous();
  const at::Tensor counts = counts_in.contiguous();
  const int64_t B = confidence.size(0), n = confidence.size(1);
  at::Tensor transfer = at::empty({B, n}, candidates.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (confidence.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(cuda::launch_select_transfer<double>(confidence.data_ptr<double>(), candidates.data_ptr<bool>(),
                                                        counts.data_ptr<int64_t>(), B, n, threshold,
                                                        transfer.data_ptr<bool>(), stream));
  } else {
    C10_CUDA_CHECK(cuda::launch_select_transfer<float>(confidence.data_ptr<float>(), candidates.data_ptr<bool>(),
                                                       counts.data_ptr<int64_t>(), B, n, threshold,
                                                       transfer.data_ptr<bool>(), stream));
  }
  return transfer;
}

std::tuple<at::Tensor, at::Tensor> masked_logprobs_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                        const at::Tensor& targets, int64_t chunk_size) {
  check_masked_logprobs_args(hidden, weight, targets, chunk_size);
  const c10::cuda::CUDAGuard guard(hidden.device());
  if (accumulate_type(hidden.scalar_type()) == at::kDouble) {
    return forward_impl<double>(hidden, weight, targets, chunk_size);
  }
  return forward_impl<float>(hidden, weight, targets, chunk_size);
}

std::tuple<at::Tensor, at::Tensor> masked_logprobs_backward_cuda(
    const std::optional<at::Tensor>& grad_logp, const std::optional<at::Tensor>& grad_lse, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse, int64_t chunk_size,
    std::array<bool, 2> output_mask) {
  check_masked_logprobs_args(hidden, weight, targets, chunk_size);
  const c10::cuda::CUDAGuard guard(hidden.device());
  if (accumulate_type(hidden.scalar_type()) == at::kDouble) {
    return backward_impl<double>(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask);
  }
  return backward_impl<float>(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask);
}

}  // namespace dllm_fast
