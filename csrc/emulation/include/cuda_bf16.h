// Stand-in for cuda_bf16.h in the emulated build: bfloat16 as its 16 bits, rounded to nearest even.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};

inline __nv_bfloat16 __float2bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((bits >> 16) | 0x40u)};  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(bits >> 16)};
}
