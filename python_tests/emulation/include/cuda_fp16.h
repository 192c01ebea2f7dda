// Stand-in for CUDA's cuda_fp16.h in the emulated build: the half type and the conversions csrc/cuda uses,
// rounding to nearest even (subnormals kept, overflow to inf) as the GPU's cvt.rn does, like torch's c10::Half.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

struct __half {
  uint16_t __x;
};

inline __half __float2half_rn(float value) { return __half{c10::Half(value).x}; }
inline float __half2float(__half value) { return static_cast<float>(c10::Half(value.__x, c10::Half::from_bits())); }
