// What a kernel needs so that one source runs on a GPU (nvcc) and in the host emulator of the test-only build
// (python_tests/emulation, where DLLM_FAST_EMULATED_CUDA is defined):
//   DLLM_FAST_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...)   instead of kernel<<<...>>>(args...)
//   __shared__ SharedArray<T, N> name;                                       instead of __shared__ T name[N];
// and the grid arithmetic of the launchers, which never exceeds the hardware's grid limit: kernels stride over
// the rows (or items) that do not get a block of their own.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#if defined(DLLM_FAST_EMULATED_CUDA)
#include "dllm_fast_emulation/runtime.h"
#define DLLM_FAST_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::dllm_fast::emulation::Launcher(#__VA_ARGS__, __VA_ARGS__, grid, block, shared_bytes, stream)
#else
#define DLLM_FAST_LAUNCH(grid, block, shared_bytes, stream, ...) __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif

namespace dllm_fast::cuda {

#if defined(DLLM_FAST_EMULATED_CUDA)
template <typename T, int N>
using SharedArray = ::dllm_fast::emulation::SharedArray<T, N>;
inline int64_t max_grid_x() { return ::dllm_fast::emulation::grid_limit_x(); }
#else
template <typename T, int N>
using SharedArray = T[N];
inline int64_t max_grid_x() { return 2147483647; }  // gridDim.x's limit since compute capability 3.0
#endif

// Blocks of a kernel that gives each of `rows` rows a block while the grid allows and strides over the rest:
// for (int64_t row = blockIdx.x; row < rows; row += gridDim.x). At least 1 (launchers skip rows == 0).
inline unsigned row_grid(int64_t rows, int64_t limit = max_grid_x()) {
  return static_cast<unsigned>(rows < 1 ? 1 : (rows < limit ? rows : limit));
}

// Blocks of `threads` threads for `items` items, one item per thread while the grid allows, the rest strided:
// for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < items; i += int64_t{gridDim.x} * blockDim.x).
inline unsigned item_grid(int64_t items, int threads, int64_t limit = max_grid_x()) {
  return row_grid((items + threads - 1) / threads, limit);
}

}  // namespace dllm_fast::cuda
