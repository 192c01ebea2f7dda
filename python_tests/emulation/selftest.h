// Launchers of the emulator's self-test kernels (selftest.cu); torch-free like the kernels of csrc/cuda.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace dllm_fast::emulation::selftest {

// Launches the self-test kernel `kernel` on data[0, n) (its own layout; see selftest.cu) with blocks x threads.
// *known is false, and nothing runs, for an unknown name.
cudaError_t run(const std::string& kernel, float* data, int64_t n, unsigned blocks, unsigned threads, bool* known);

// out[row, call] = the block logsumexp of x[row] (rows x cols), reduced `calls` times in a row by blocks of
// `threads` threads.
template <typename acc_t>
cudaError_t reduce_logsumexp_rows(const acc_t* x, int64_t rows, int64_t cols, int calls, unsigned threads, acc_t* out);

}  // namespace dllm_fast::emulation::selftest
