// Torch glue of dllm_fast::select_transfer on CUDA (compiled only in CUDA builds): device guard
// and stream, and the torch-free kernel of sampling.cu.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "dllm_fast/ops.h"
#include "sampling.cuh"

namespace dllm_fast {

at::Tensor select_transfer_cuda(const at::Tensor& confidence_in, const at::Tensor& candidates_in,
                                const at::Tensor& counts_in, double threshold) {
  const c10::cuda::CUDAGuard guard(confidence_in.device());
  const at::Tensor confidence = confidence_in.contiguous(), candidates = candidates_in.contiguous();
  const at::Tensor counts = counts_in.contiguous();
  const int64_t B = confidence.size(0), n = confidence.size(1);
  at::Tensor transfer = at::empty({B, n}, candidates.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // confidence is float32 or float64 (checked), its own accumulator type.
  dispatch_accumulate(confidence.scalar_type(), [&](auto acc) {
    using conf_t = decltype(acc);
    C10_CUDA_CHECK(cuda::launch_select_transfer<conf_t>(confidence.data_ptr<conf_t>(), candidates.data_ptr<bool>(),
                                                        counts.data_ptr<int64_t>(), B, n, threshold,
                                                        transfer.data_ptr<bool>(), stream));
  });
  return transfer;
}

}  // namespace dllm_fast
