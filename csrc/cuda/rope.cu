// CUDA kernel of dllm_fast::rope (see rope.cuh): the rotary embedding of the query and key heads of a fused QKV
// projection in one pass over it, where the composite took a product with both tables, a roll and a sum (three
// kernels through fp32 temporaries twice x's size).

#include "device_math.cuh"
#include "launch.cuh"
#include "rope.cuh"

namespace dllm_fast::cuda {
namespace {

// The products and the sum rounded as the composite rounds them: never contracted into a multiply-add.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// A block per (b, l) row, striding over the rows beyond the grid; its threads walk the row's heads * D elements.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const scalar_t* __restrict__ x, int64_t xb, int64_t xl, int64_t xh, const acc_t* __restrict__ tables,
                int64_t tp, int64_t tb, int64_t tl, int64_t L, int64_t rows, int heads, int D, int rotated_heads,
                scalar_t* __restrict__ out) {
  const int half = D / 2, width = heads * D;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t b = row / L, l = row % L;
    const scalar_t* in = x + b * xb + l * xl;
    const acc_t* cos = tables + b * tb + l * tl;
    const acc_t* sin = cos + tp;  // sin on the first half, -sin on the second (layers.rope_tables)
    scalar_t* o = out + row * width;
    for (int k = threadIdx.x; k < width; k += blockDim.x) {
      const int h = k / D, j = k - h * D;
      const scalar_t* head = in + h * xh;
      if (h >= rotated_heads) {
        o[k] = head[j];
        continue;
      }
      const int p = j < half ? j + half : j - half;  // the element roll(., D / 2) moves to j
      const acc_t straight = mul_rn(to_acc<acc_t>(head[j]), cos[j]);
      const acc_t turned = mul_rn(to_acc<acc_t>(head[p]), sin[p]);
      store_rounded(o + k, add_rn(straight, turned));
    }
  }
}

}  // namespace

template <typename scalar_t, typename acc_t>
cudaError_t launch_rope(const scalar_t* x, int64_t xb, int64_t xl, int64_t xh, const acc_t* tables, int64_t tp,
                        int64_t tb, int64_t tl, int64_t B, int64_t L, int64_t heads, int64_t D,
                        int64_t rotated_heads, scalar_t* out, cudaStream_t stream) {
  const int64_t rows = B * L;
  if (rows == 0 || heads * D == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(row_grid(rows), kThreads, 0, stream, rope_kernel<scalar_t, acc_t>)(
      x, xb, xl, xh, tables, tp, tb, tl, L, rows, static_cast<int>(heads), static_cast<int>(D),
      static_cast<int>(rotated_heads), out);
  return cudaGetLastError();
}

#define DLLM_FAST_INSTANTIATE_ROPE(scalar_t, acc_t)                                                               \
  template cudaError_t launch_rope<scalar_t, acc_t>(const scalar_t*, int64_t, int64_t, int64_t, const acc_t*,     \
                                                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                                    int64_t, scalar_t*, cudaStream_t);
DLLM_FAST_INSTANTIATE_ROPE(float, float)
DLLM_FAST_INSTANTIATE_ROPE(double, double)
DLLM_FAST_INSTANTIATE_ROPE(__nv_bfloat16, float)
DLLM_FAST_INSTANTIATE_ROPE(__half, float)
#undef DLLM_FAST_INSTANTIATE_ROPE

}  // namespace dllm_fast::cuda
