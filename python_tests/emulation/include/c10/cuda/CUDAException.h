// Stand-in for c10/cuda/CUDAException.h in the emulated build: C10_CUDA_CHECK raises as c10's does, and adds
// the emulator's account of the failure (the kernel, block, threads and source lines).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#define C10_CUDA_CHECK(EXPR)                                                                               \
  do {                                                                                                     \
    const cudaError_t dllm_fast_emulated_error = (EXPR);                                                   \
    TORCH_CHECK(dllm_fast_emulated_error == cudaSuccess, "CUDA error: ",                                  \
                cudaGetErrorString(dllm_fast_emulated_error), " (emulated): ",                             \
                ::dllm_fast::emulation::last_error_message());                                             \
  } while (0)
