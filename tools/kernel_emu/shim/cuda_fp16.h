// CPU stand-in for cuda_fp16.h (emulator only).
#pragma once
#include "cuda_runtime.h"
struct __half {
  _Float16 v;
};
inline float __half2float(__half h) { return float(h.v); }
inline __half __float2half_rn(float f) { return __half{static_cast<_Float16>(f)}; }  // round to nearest even
