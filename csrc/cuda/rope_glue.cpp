// Torch glue of dllm_fast::rope on CUDA (compiled only in CUDA builds): device guard, stream, dtype dispatch and
// the torch-free kernel of rope.cu.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dllm_fast/ops.h"
#include "rope.cuh"

namespace dllm_fast {
namespace {

template <typename scalar_t, typename acc_t>
void launch(const at::Tensor& x, const at::Tensor& tables, int64_t rotated_heads, at::Tensor& out) {
  const cudaError_t error = cuda::launch_rope<scalar_t, acc_t>(
      reinterpret_cast<const scalar_t*>(x.data_ptr()), x.stride(0), x.stride(1), x.stride(2),
      tables.data_ptr<acc_t>(), tables.stride(0), tables.stride(1), tables.stride(2), x.size(0), x.size(1),
      x.size(2), x.size(3), rotated_heads, reinterpret_cast<scalar_t*>(out.data_ptr()),
      at::cuda::getCurrentCUDAStream());
  C10_CUDA_CHECK(error);
}

}  // namespace

at::Tensor rope_cuda(const at::Tensor& x, const at::Tensor& tables, int64_t rotated_heads) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  switch (x.scalar_type()) {
    case at::kBFloat16: launch<__nv_bfloat16, float>(x, tables, rotated_heads, out); break;
    case at::kHalf: launch<__half, float>(x, tables, rotated_heads, out); break;
    case at::kFloat: launch<float, float>(x, tables, rotated_heads, out); break;
    case at::kDouble: launch<double, double>(x, tables, rotated_heads, out); break;
    default: TORCH_CHECK(false, "rope: x must be bf16, fp16, fp32 or fp64, got ", x.scalar_type());
  }
  return out;
}

}  // namespace dllm_fast
