// Kernels that test the emulator itself (python_tests/test_emulator.py): cooperation through barriers, shared
// memory and warp collectives that must work, and mistakes that it must report by the kernel's name. Also a
// harness for the device helpers of csrc/cuda (block reductions at any block size). Emulated build only.

#include "selftest.h"

#include <cstring>
#include <string>

#include "device_math.cuh"
#include "launch.cuh"

namespace dllm_fast::emulation::selftest {
namespace {

using cuda::SharedArray;

constexpr int kMaxThreads = 1024;

// Thread t publishes data[t] and reads its neighbour's after the barrier.
__global__ void rotate_through_shared(float* data, int64_t) {
  __shared__ SharedArray<float, kMaxThreads> slots;
  const unsigned t = threadIdx.x;
  slots[t] = data[blockIdx.x * blockDim.x + t];
  __syncthreads();
  data[blockIdx.x * blockDim.x + t] = slots[(t + 1) % blockDim.x];
}

__global__ void exit_before_barrier(float*, int64_t) {
  if (threadIdx.x % 2 == 1) return;
  __syncthreads();
}

__global__ void divergent_barriers(float*, int64_t) {
  if (threadIdx.x % 2 == 1) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void barrier_against_shuffle(float* data, int64_t) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    data[threadIdx.x] = __shfl_down_sync(0xffffffffu, data[threadIdx.x], 1);
  }
}

// Per thread, five results of the warp collectives over the values data[t] (t < blockDim.x), for every lane of a
// possibly partial last warp: a shuffle-down sum, a butterfly (xor) sum, lane 3's value, an inclusive prefix
// sum (shuffle up) and the ballot of positive values, written to data[blockDim.x + 5 t + k].
__global__ void warp_collectives(float* data, int64_t) {
  const unsigned t = threadIdx.x, lane = t % 32, lanes = min(32u, blockDim.x - t / 32 * 32);
  const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  const float x = data[t];
  float down = x, butterfly = x, scan = x;
  for (unsigned offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_down_sync(mask, down, offset);
    if (lane + offset < lanes) down += other;
  }
  for (int lane_mask = 1; lane_mask < 32; lane_mask <<= 1) {
    const float other = __shfl_xor_sync(mask, butterfly, lane_mask);
    if ((lane ^ lane_mask) < lanes) butterfly += other;
  }
  for (unsigned offset = 1; offset < 32; offset <<= 1) {
    const float other = __shfl_up_sync(mask, scan, offset);
    if (lane >= offset) scan += other;
  }
  const float third = __shfl_sync(mask, x, 3 % lanes);
  const unsigned positive = __ballot_sync(mask, x > 0);
  __syncwarp(mask);
  float* out = data + blockDim.x + 5 * t;
  out[0] = down;
  out[1] = butterfly;
  out[2] = third;
  out[3] = scan;
  out[4] = static_cast<float>(positive);
}

__global__ void shuffle_with_exited_lane(float* data, int64_t) {
  if (threadIdx.x == 31) return;
  data[threadIdx.x] = __shfl_down_sync(0xffffffffu, data[threadIdx.x], 1);
}

__global__ void shuffle_past_the_block(float* data, int64_t) {
  data[threadIdx.x] = __shfl_down_sync(0xffffffffu, data[threadIdx.x], 1);
}

__global__ void read_unwritten_shared(float* data, int64_t) {
  __shared__ SharedArray<float, 8> slots;
  if (threadIdx.x == 0) {
    slots[0] = 1.0f;
    data[0] = slots[1];
  }
}

__global__ void read_without_barrier(float* data, int64_t) {
  __shared__ SharedArray<float, 8> slots;
  if (threadIdx.x == 0) slots[0] = 1.0f;
  if (threadIdx.x == 1) data[1] = slots[0];
}

__global__ void write_after_read_without_barrier(float* data, int64_t) {
  __shared__ SharedArray<float, 8> slots;
  slots[threadIdx.x] = data[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) data[0] = slots[1];
  if (threadIdx.x == 1) slots[1] = 2.0f;
}

__global__ void shared_index_out_of_bounds(float* data, int64_t) {
  __shared__ SharedArray<float, 8> slots;
  slots[threadIdx.x] = data[threadIdx.x];
}

// Every thread of every block adds 1 to data[0] (global memory) and to one of 4 shared counters, whose block
// totals go to data[1 + 4 b + i].
__global__ void atomics(float* data, int64_t) {
  __shared__ SharedArray<unsigned, 4> counts;
  if (threadIdx.x < 4) counts[threadIdx.x] = 0u;
  __syncthreads();
  atomicAdd(&counts[threadIdx.x % 4], 1u);
  atomicAdd(data, 1.0f);
  __syncthreads();
  if (threadIdx.x < 4) data[1 + 4 * blockIdx.x + threadIdx.x] = static_cast<float>(counts[threadIdx.x]);
}

// One past the end of data: AddressSanitizer must name this kernel.
__global__ void read_past_the_end(float* data, int64_t n) { data[0] = data[n + threadIdx.x]; }

// One block per row: each thread folds its strided columns of x[row] into a logsumexp pair, then the block
// reduces them `calls` times in a row (every call must give the same value, and the first the row's).
template <typename acc_t>
__global__ void reduce_logsumexp(const acc_t* x, int64_t cols, int calls, acc_t* out) {
  const int64_t row = blockIdx.x;
  acc_t m = -INFINITY, s = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) cuda::logsumexp_add(m, s, x[row * cols + j]);
  for (int call = 0; call < calls; ++call) {
    acc_t call_m = m, call_s = s;
    cuda::block_logsumexp(call_m, call_s);
    if (threadIdx.x == 0) out[row * calls + call] = cuda::logsumexp_value(call_m, call_s);
  }
}

}  // namespace

cudaError_t run(const std::string& kernel, float* data, int64_t n, unsigned blocks, unsigned threads, bool* known) {
  *known = true;
  if (kernel == "rotate_through_shared") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, rotate_through_shared)(data, n);
  } else if (kernel == "exit_before_barrier") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, exit_before_barrier)(data, n);
  } else if (kernel == "divergent_barriers") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, divergent_barriers)(data, n);
  } else if (kernel == "barrier_against_shuffle") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, barrier_against_shuffle)(data, n);
  } else if (kernel == "warp_collectives") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, warp_collectives)(data, n);
  } else if (kernel == "shuffle_with_exited_lane") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, shuffle_with_exited_lane)(data, n);
  } else if (kernel == "shuffle_past_the_block") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, shuffle_past_the_block)(data, n);
  } else if (kernel == "read_unwritten_shared") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, read_unwritten_shared)(data, n);
  } else if (kernel == "read_without_barrier") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, read_without_barrier)(data, n);
  } else if (kernel == "write_after_read_without_barrier") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, write_after_read_without_barrier)(data, n);
  } else if (kernel == "shared_index_out_of_bounds") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, shared_index_out_of_bounds)(data, n);
  } else if (kernel == "atomics") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, atomics)(data, n);
  } else if (kernel == "read_past_the_end") {
    DLLM_FAST_LAUNCH(blocks, threads, 0, nullptr, read_past_the_end)(data, n);
  } else {
    *known = false;
    return cudaSuccess;
  }
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t reduce_logsumexp_rows(const acc_t* x, int64_t rows, int64_t cols, int calls, unsigned threads, acc_t* out) {
  DLLM_FAST_LAUNCH(static_cast<unsigned>(rows), threads, 0, nullptr, reduce_logsumexp<acc_t>)(x, cols, calls, out);
  return cudaGetLastError();
}

template cudaError_t reduce_logsumexp_rows<float>(const float*, int64_t, int64_t, int, unsigned, float*);
template cudaError_t reduce_logsumexp_rows<double>(const double*, int64_t, int64_t, int, unsigned, double*);

}  // namespace dllm_fast::emulation::selftest
