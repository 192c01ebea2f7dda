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

// VEC consecutive elements moved as one aligned load or store (16 bytes at most: one vector instruction).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

// A thread per (row, head, VEC-wide slice of the first half of D). Element j of the first half and j + D/2 of
// the second are each other's partners under roll(., D / 2), so a thread reads both halves' slices once and writes
// both. Bandwidth-bound: the one-block-per-row form left most of the GPU idle at a denoising step's few hundred
// rows (0.85 ms a step at LLaDA-8B, batch 8, against about 0.1 ms of bytes).
template <typename scalar_t, typename acc_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const scalar_t* __restrict__ x, int64_t xb, int64_t xl, int64_t xh, const acc_t* __restrict__ tables,
                int64_t tp, int64_t tb, int64_t tl, int64_t L, int64_t items, int heads, int D, int rotated_heads,
                scalar_t* __restrict__ out) {
  const int half = D / 2, slices = half / VEC;
  const int64_t per_row = int64_t{heads} * slices;
  for (int64_t item = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; item < items;
       item += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = item / per_row;
    const int rest = static_cast<int>(item - row * per_row);
    const int h = rest / slices, j = (rest - h * slices) * VEC;
    const int64_t b = row / L, l = row - b * L;
    const scalar_t* in = x + b * xb + l * xl + h * xh;
    scalar_t* o = out + (row * heads + h) * D;
    const Pack<scalar_t, VEC> first = load<scalar_t, VEC>(in + j), second = load<scalar_t, VEC>(in + half + j);
    if (h >= rotated_heads) {  // a value head: copied
      *reinterpret_cast<Pack<scalar_t, VEC>*>(o + j) = first;
      *reinterpret_cast<Pack<scalar_t, VEC>*>(o + half + j) = second;
      continue;
    }
    // cos on both halves; sin on the first half and -sin on the second (layers.rope_tables).
    const acc_t* cos = tables + b * tb + l * tl;
    const Pack<acc_t, VEC> cos1 = load<acc_t, VEC>(cos + j), cos2 = load<acc_t, VEC>(cos + half + j);
    const Pack<acc_t, VEC> sin1 = load<acc_t, VEC>(cos + tp + j), sin2 = load<acc_t, VEC>(cos + tp + half + j);
    Pack<scalar_t, VEC> out1, out2;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const acc_t x1 = to_acc<acc_t>(first.v[v]), x2 = to_acc<acc_t>(second.v[v]);
      store_rounded(&out1.v[v], add_rn(mul_rn(x1, cos1.v[v]), mul_rn(x2, sin2.v[v])));
      store_rounded(&out2.v[v], add_rn(mul_rn(x2, cos2.v[v]), mul_rn(x1, sin1.v[v])));
    }
    *reinterpret_cast<Pack<scalar_t, VEC>*>(o + j) = out1;
    *reinterpret_cast<Pack<scalar_t, VEC>*>(o + half + j) = out2;
  }
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename scalar_t, typename acc_t, int VEC>
cudaError_t launch(const scalar_t* x, int64_t xb, int64_t xl, int64_t xh, const acc_t* tables, int64_t tp,
                   int64_t tb, int64_t tl, int64_t B, int64_t L, int64_t heads, int64_t D, int64_t rotated_heads,
                   scalar_t* out, cudaStream_t stream) {
  const int64_t items = B * L * heads * (D / 2 / VEC);
  DLLM_FAST_LAUNCH(item_grid(items, kThreads), kThreads, 0, stream, rope_kernel<scalar_t, acc_t, VEC>)(
      x, xb, xl, xh, tables, tp, tb, tl, L, items, static_cast<int>(heads), static_cast<int>(D),
      static_cast<int>(rotated_heads), out);
  return cudaGetLastError();
}

// Whether every address a VEC-wide thread touches is a multiple of its pack's size: pointers, strides and D / 2.
template <typename scalar_t, typename acc_t>
bool vectorizable(int VEC, const scalar_t* x, int64_t xb, int64_t xl, int64_t xh, const acc_t* tables, int64_t tp,
                  int64_t tb, int64_t tl, int64_t D, const scalar_t* out) {
  const int64_t half = D / 2;
  return half % VEC == 0 && xb % VEC == 0 && xl % VEC == 0 && xh % VEC == 0 && tp % VEC == 0 && tb % VEC == 0 &&
         tl % VEC == 0 && aligned(x, VEC * sizeof(scalar_t)) && aligned(out, VEC * sizeof(scalar_t)) &&
         aligned(tables, VEC * sizeof(acc_t));
}

}  // namespace

template <typename scalar_t, typename acc_t>
cudaError_t launch_rope(const scalar_t* x, int64_t xb, int64_t xl, int64_t xh, const acc_t* tables, int64_t tp,
                        int64_t tb, int64_t tl, int64_t B, int64_t L, int64_t heads, int64_t D,
                        int64_t rotated_heads, scalar_t* out, cudaStream_t stream) {
  if (B * L == 0 || heads * D == 0) return cudaSuccess;
  // The widest pack of at most 16 bytes of activations the layout allows; one element at a time otherwise.
  constexpr int kWidest = 16 / sizeof(scalar_t) < 8 ? 16 / sizeof(scalar_t) : 8;
  if (vectorizable(kWidest, x, xb, xl, xh, tables, tp, tb, tl, D, out))
    return launch<scalar_t, acc_t, kWidest>(x, xb, xl, xh, tables, tp, tb, tl, B, L, heads, D, rotated_heads, out,
                                            stream);
  if (vectorizable(2, x, xb, xl, xh, tables, tp, tb, tl, D, out))
    return launch<scalar_t, acc_t, 2>(x, xb, xl, xh, tables, tp, tb, tl, B, L, heads, D, rotated_heads, out,
                                      stream);
  return launch<scalar_t, acc_t, 1>(x, xb, xl, xh, tables, tp, tb, tl, B, L, heads, D, rotated_heads, out, stream);
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
