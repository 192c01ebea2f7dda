// Launcher of the rotary-embedding CUDA kernel. Torch-free: raw pointers, sizes, element strides and a stream
// (the torch side is rope_glue.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace dllm_fast::cuda {

// x [B, L, heads, D] with element strides (xb, xl, xh) and the last dimension contiguous; tables [2, B, L, 1, D]
// with strides (tp, tb, tl) and the last dimension contiguous; out [B, L, heads, D] contiguous. The first
// rotated_heads heads: out = x * tables[0] + roll(x * tables[1], D / 2), in acc_t without fused multiply-adds,
// rounded once to scalar_t; the other heads copied. D even.
template <typename scalar_t, typename acc_t>
cudaError_t launch_rope(const scalar_t* x, int64_t xb, int64_t xl, int64_t xh, const acc_t* tables, int64_t tp,
                        int64_t tb, int64_t tl, int64_t B, int64_t L, int64_t heads, int64_t D,
                        int64_t rotated_heads, scalar_t* out, cudaStream_t stream);

}  // namespace dllm_fast::cuda
