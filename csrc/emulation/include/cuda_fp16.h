// Stand-in for cuda_fp16.h in the emulated build: IEEE half precision, converted with the host's rounding.
#pragma once

typedef _Float16 __half;

inline __half __float2half(float value) { return static_cast<__half>(value); }
inline float __half2float(__half value) { return static_cast<float>(value); }
