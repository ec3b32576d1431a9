// CPU stand-in for hip/hip_bfloat16.h (emulator only): hip_bfloat16 converts from float with round to nearest
// even and to float by static_cast, as ROCm's does.
#pragma once
#include <cstdint>
#include <cstring>
#include "../cuda_bf16.h"
struct hip_bfloat16 {
  uint16_t data;
  hip_bfloat16() = default;
  explicit hip_bfloat16(float f) : data(__float2bfloat16_rn(f).bits) {}
  explicit operator float() const { return __bfloat162float(__nv_bfloat16{data}); }
};
