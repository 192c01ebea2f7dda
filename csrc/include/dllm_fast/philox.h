// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), a counter-based RNG:
// the output is a pure function of (counter, key), so any (seed, step, row, column) gets its own numbers on
// CPU and GPU alike, in any order. Torch-free; usable from C++ and CUDA device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DLLM_FAST_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DLLM_FAST_HOST_DEVICE inline __attribute__((always_inline))
#endif

namespace dllm_fast {

struct PhiloxWords {
  uint32_t w[4];
};

DLLM_FAST_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

DLLM_FAST_HOST_DEVICE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi32(kMul0, c0), lo0 = kMul0 * c0;
    const uint32_t hi1 = mulhi32(kMul1, c2), lo1 = kMul1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// The Gumbel noise of token column `col` of sampling row `row` at step `offset` under `seed`: counter
// (col / 4, row low, row high, offset), key (seed low, seed high), word col % 4.
DLLM_FAST_HOST_DEVICE PhiloxWords philox_for_quad(uint64_t seed, uint32_t offset, uint64_t row, uint32_t quad) {
  return philox4x32_10(quad, static_cast<uint32_t>(row), static_cast<uint32_t>(row >> 32), offset,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// (w + 1/2) / 2^32 in float, capped at the largest float below 1: in (0, 1), so the Gumbel transform sees
// neither log(0) nor log1p(-1). Without the cap the 128 words from 0xFFFFFF80 round to exactly 1.0 (float keeps
// 24 bits), whose noise is -inf: a token that could never win its draw.
DLLM_FAST_HOST_DEVICE float uniform_open(uint32_t word) {
  const float v = static_cast<float>(word) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
  return v < 0x1.fffffep-1f ? v : 0x1.fffffep-1f;
}

}  // namespace dllm_fast
