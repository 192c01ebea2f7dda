// Stand-in for CUDA's cuda_runtime.h in the emulated build only (python_tests/emulation/include comes first on its
// include path): the CUDA C++ that csrc/cuda/*.cu use, compiled by the host compiler and run by the emulator in
// dllm_fast_emulation/runtime.h. Add here what a new kernel needs, and a test in python_tests/test_emulator.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dllm_fast_emulation/runtime.h"
#include "dllm_fast_emulation/types.h"

#define DLLM_FAST_EMULATED_CUDA 1

// Function and variable qualifiers: every function is an ordinary host function. `__shared__` variables are
// per OS thread (all fibers of a block share it); declare them as SharedArray (see dllm_fast/launch.cuh).
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local

// The built-in variables of the running thread.
#define threadIdx (::dllm_fast::emulation::thread_index())
#define blockIdx (::dllm_fast::emulation::block_index())
#define blockDim (::dllm_fast::emulation::block_dim())
#define gridDim (::dllm_fast::emulation::grid_dim())
constexpr int warpSize = 32;

// CUDA's device min and max.
template <typename T>
constexpr T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
constexpr T max(T a, T b) {
  return a < b ? b : a;
}

// Arithmetic rounded to nearest and never contracted into a multiply-add: the host build targets plain x86-64
// (no -mfma), so the host compiler has no fused multiply-add to contract into.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::dllm_fast::emulation::barrier(file, line);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  ::dllm_fast::emulation::warp_collective(::dllm_fast::emulation::Collective::kSyncWarp, mask, 0, 0, warpSize,
                                          file, line);
}

namespace dllm_fast::emulation {

template <typename T>
T shuffle(Collective kind, unsigned mask, T value, int operand, int width, const char* file, int line) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t), "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_collective(kind, mask, bits, operand, width, file, line);
  T result;
  std::memcpy(&result, &bits, sizeof(T));
  return result;
}

}  // namespace dllm_fast::emulation

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
  return ::dllm_fast::emulation::shuffle(::dllm_fast::emulation::Collective::kShuffleIndex, mask, var, src_lane,
                                         width, file, line);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE()) {
  return ::dllm_fast::emulation::shuffle(::dllm_fast::emulation::Collective::kShuffleUp, mask, var,
                                         static_cast<int>(delta), width, file, line);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE()) {
  return ::dllm_fast::emulation::shuffle(::dllm_fast::emulation::Collective::kShuffleDown, mask, var,
                                         static_cast<int>(delta), width, file, line);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, const char* file = __builtin_FILE(),
                  int line = __builtin_LINE()) {
  return ::dllm_fast::emulation::shuffle(::dllm_fast::emulation::Collective::kShuffleXor, mask, var, lane_mask,
                                         width, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return static_cast<unsigned>(::dllm_fast::emulation::warp_collective(
      ::dllm_fast::emulation::Collective::kBallot, mask, predicate != 0, 0, warpSize, file, line));
}

// Atomics. Fibers never interrupt one another between two instructions, but the read-modify-write is atomic
// anyway, so the emulator stays right if blocks ever run on several OS threads.
template <typename T>
T __emulated_atomic_add(T* address, T value) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
  } else {
    T old, desired;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    do {
      desired = old + value;
    } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
  }
}
inline int atomicAdd(int* address, int value) { return __emulated_atomic_add(address, value); }
inline unsigned atomicAdd(unsigned* address, unsigned value) { return __emulated_atomic_add(address, value); }
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __emulated_atomic_add(address, value);
}
inline float atomicAdd(float* address, float value) { return __emulated_atomic_add(address, value); }
inline double atomicAdd(double* address, double value) { return __emulated_atomic_add(address, value); }
template <typename T>
T atomicAdd(::dllm_fast::emulation::SharedPtr<T> address, T value) {
  return atomicAdd(address.claim_atomic(), value);
}

inline const char* cudaGetErrorString(cudaError_t error) { return ::dllm_fast::emulation::error_name(error); }
inline cudaError_t cudaGetLastError() { return ::dllm_fast::emulation::take_last_error(); }
