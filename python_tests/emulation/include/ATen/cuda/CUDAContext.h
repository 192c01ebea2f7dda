// Stand-in for ATen/cuda/CUDAContext.h in the emulated build: the current stream and cuBLAS handle of the
// emulated device (placeholders; the emulator runs every launch and GEMM at once, in order).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace at::cuda {

inline cudaStream_t getCurrentCUDAStream() { return nullptr; }
inline cublasHandle_t getCurrentCUDABlasHandle() { return nullptr; }

}  // namespace at::cuda
