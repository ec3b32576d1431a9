// Rows over time between a (batch, dim, L) tensor and a kernel's float workspace, shared by the CPU kernels (the
// selective scan, the causal conv): in scan order, back to front in reverse mode, so that everything between load
// and store is the same code (and the same operations) for both directions. bfloat16 is converted with
// c10::BFloat16's own rounding (to nearest even; NaN to 0x7FC0), written without branches so that the loops vectorise.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#include "cpu_isa.h"

namespace vim_ds {
namespace scan_cpu {

template <typename acc_t>
SCAN_INLINE acc_t to_acc(acc_t v) {
  return v;
}
SCAN_INLINE float to_acc(c10::BFloat16 v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(v.x) << 16);
}

template <typename in_t, typename acc_t>
SCAN_INLINE in_t from_acc(acc_t v) {
  if constexpr (std::is_same<in_t, c10::BFloat16>::value) {
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // c10::round_to_nearest_even
    return in_t(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), in_t::from_bits());
  } else {
    return static_cast<in_t>(v);
  }
}

// dst[t] = src[t] (src[L-1-t] in reverse mode) in the accumulation type, t < L.
template <typename in_t, typename acc_t>
SCAN_INLINE void load_row(const in_t* __restrict src, int64_t L, acc_t* __restrict dst, bool reverse) {
  if (reverse) {
    for (int64_t t = 0; t < L; ++t) dst[t] = to_acc(src[L - 1 - t]);
  } else {
    for (int64_t t = 0; t < L; ++t) dst[t] = to_acc(src[t]);
  }
}

// The inverse: dst[t] (dst[L-1-t]) = src[t] in the input type.
template <typename in_t, typename acc_t>
SCAN_INLINE void store_row(const acc_t* __restrict src, int64_t L, in_t* __restrict dst, bool reverse) {
  if (reverse) {
    for (int64_t t = 0; t < L; ++t) dst[L - 1 - t] = from_acc<in_t>(src[t]);
  } else {
    for (int64_t t = 0; t < L; ++t) dst[t] = from_acc<in_t>(src[t]);
  }
}

}  // namespace scan_cpu
}  // namespace vim_ds
