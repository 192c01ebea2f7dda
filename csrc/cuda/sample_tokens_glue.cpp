// Torch glue of dllm_fast::sample_tokens on CUDA (compiled only in CUDA builds): device guard
// and stream, the per-chunk cuBLAS GEMMs, and the torch-free kernels of sampling.cu.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>

#include "blas.h"
#include "dllm_fast/gumbel_max.h"
#include "dllm_fast/ops.h"
#include "sampling.cuh"

namespace dllm_fast {
namespace {

constexpr const char* kOp = "sample_tokens";

// The face refuses longer lists on every device; this only guards the fixed array of a direct call.
cuda::TokenList token_list(at::IntArrayRef ids, const char* what) {
  TORCH_CHECK(static_cast<int64_t>(ids.size()) <= cuda::TokenList::kCapacity, kOp, ": at most ",
              cuda::TokenList::kCapacity, " ", what, ", got ", ids.size(), ".");
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
  const SampleScales<acc_t> scales = sample_scales<acc_t>(temperature);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    // logits[N, c] = hidden[N, d] @ weight[v0:v0+c, d]^T
    blas::gemm(kOp, false, true, N, c, d, hidden.data_ptr(), hidden.scalar_type(), d,
               blas::element_address(weight, v0 * d), weight.scalar_type(), d, logits.data_ptr(), acc, c, 1.0, 0.0);
    C10_CUDA_CHECK(cuda::launch_sample_chunk<acc_t>(logits.data_ptr<acc_t>(), N, c, c, v0, row_ids.data_ptr<int64_t>(),
                                                    greedy, scales.logit, scales.noise, static_cast<uint64_t>(seed),
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
  const c10::cuda::CUDAGuard guard(hidden.device());
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return sample_impl<decltype(acc)>(hidden, weight, row_ids, temperature, seed, offset, suppress_ids,
                                      confidence_exclude_ids, chunk_size);
  });
}

}  // namespace dllm_fast
