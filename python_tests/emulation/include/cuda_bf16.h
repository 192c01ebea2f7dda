// Stand-in for CUDA's cuda_bf16.h in the emulated build: the bfloat16 type and the conversions csrc/cuda uses,
// rounding to nearest even as the GPU's cvt.rn does (torch's c10::BFloat16 rounds the same way).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

struct __nv_bfloat16 {
  uint16_t __x;
};

inline __nv_bfloat16 __float2bfloat16_rn(float value) { return __nv_bfloat16{c10::BFloat16(value).x}; }
inline float __bfloat162float(__nv_bfloat16 value) {
  return static_cast<float>(c10::BFloat16(value.__x, c10::BFloat16::from_bits()));
}
