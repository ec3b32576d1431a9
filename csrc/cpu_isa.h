// The x86-64 instruction-set variants shared by the CPU kernels (the selective scan and the causal conv): each
// kernel's loops are compiled once per variant through GCC/Clang target attributes, and the variant in use is one
// process-wide choice, the widest this CPU runs unless `set_isa` (selective_scan_cpu.h) forced a narrower one, so
// that tests and benchmarks check and compare every variant of both kernels the same way.
#pragma once

#define SCAN_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__)
#define SCAN_X86_DISPATCH 1
#define SCAN_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define SCAN_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")))
#else
#define SCAN_X86_DISPATCH 0
#endif

namespace vim_ds {
namespace scan_cpu {

// The variants, narrowest first; a CPU that has one has every narrower one. kGeneric is SSE2 on x86-64, NEON on
// aarch64, plain C++ elsewhere.
enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

// The variant in use (defined in selective_scan_cpu.cpp).
int current_isa();

}  // namespace scan_cpu
}  // namespace vim_ds
