// The counting build of the kernel emulator (compiled with EMU_COUNT; see tools/kernel_emu/README.md): what each
// kernel launch costs, counted while the real device code runs.
//   * global memory: every load and store of the kernels reaches the hooks of emu_count.cpp through the compiler's
//     ThreadSanitizer instrumentation (-fsanitize=thread gives a call per access with its address and size; we
//     supply those calls, there is no TSan runtime). Accesses to the buffers the launcher gets (inputs, outputs,
//     workspace) are grouped into warp instructions: the same call site, the same occurrence of it in each lane
//     between two switch points of the emulator (barriers, shuffles). A warp instruction moves 32 bytes per
//     distinct 32-byte sector its lanes touch.
//   * arithmetic: the accumulation type is Acc<float> (Acc<double>) instead of float (double), through the
//     kernel's SS_ACC_FLOAT / SS_ACC_DOUBLE. Its operators compute exactly what float does and tell emu_count.cpp,
//     which counts FMA-pipe operations and special-function operations (exp, log1p, the reciprocal of a
//     division), and follows each value's chain of dependent steps through registers, shuffles and memory. As a
//     compiler would: a multiply feeding an add is one fused multiply-add (nvcc's and hipcc's default
//     contraction), unless the product was first assigned to a variable that already existed (a loop-carried
//     value: the add is in the next iteration, past the loop's back edge) or stored; an operation repeated on the
//     same values between two switch points is counted once (common-subexpression elimination).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#define EMU_INLINE inline __attribute__((always_inline))

namespace emu {

// Hooks of emu_count.cpp: the buffers, the launches, the scheduler's switch points.
void count_global(const void* p, size_t bytes);  // a buffer in global memory (the launcher's arguments)
void count_clear_globals();
void count_smem(const void* p, size_t bytes);  // the block's shared memory (values stored there lose "product")
void count_launch_begin(const void* kernel, int pass, unsigned blocks, unsigned threads, int warp);
void count_lane(int tid);  // the thread that runs from now on (-1: none)
void count_launch_end();
void count_round_end();  // every thread of the block is at a switch point (or done)
void count_barrier();
void count_shuffle(int warps);
void count_shuffle_pair(int dst_tid, int src_tid);  // lane dst receives lane src's value
void count_block_begin(unsigned block);  // a block starts (blocks run one after another)
void count_block_end();

// The race check (emu_race.cpp): pairs of accesses to the same bytes, one a write, by two threads that a GPU does not
// order (of a block, with no barrier between them; of two blocks, with no release and acquire of the chain's flag
// between them), in these kinds (emu_race_kind names them; each counted once per pair of call sites).
constexpr int kRaceKinds = 7;
void race_launch(const char* kernel, int warp, uintptr_t smem_begin,
                 const std::vector<std::pair<uintptr_t, uintptr_t>>& globals);
void race_block(unsigned block);
void race_access(uintptr_t addr, size_t size, bool write, bool shared, int tid, const void* site);
void race_atomic(int kind, int tid);  // the accesses from now on: 0 plain, 1 an atomic, 2 an atomicExch (a release)
void race_round_end();  // every thread at a switch point (a barrier or a shuffle)
void race_epoch_end();  // a barrier, or the block's end: the accesses before it are checked

// The shadow of an accumulation value (at its address): what made it.
void acc_fresh(const void* self);                 // from outside: a constant, a conversion, a global load
void acc_copy(const void* dst, const void* src);    // the same value in a new variable, or loaded from memory
void acc_assign(const void* dst, const void* src);  // the same value into a variable that existed (or memory)
void acc_arith(const void* dst, char op, const void* a, const void* b);  // op: '+', '-', '*'
void acc_div(const void* dst, const void* a, const void* b, bool dividend_is_one);
void acc_neg(const void* dst, const void* a);
void acc_sfu(const void* dst, char op, const void* a);  // op: 'e' exp, 'l' log1p
void acc_shfl_send(const void* v);
void acc_shfl_recv(const void* dst);
// A row of accumulation values moved between shared memory and registers in one access of `bytes` (the kernel's
// smem_load / smem_store: one LDS.64 / LDS.128 on a GPU): one warp instruction, the values' shadows carried.
void wide_load(void* dst, const void* src, size_t bytes, size_t elem);
void wide_store(void* dst, const void* src, size_t bytes, size_t elem);

// A float (double) that reports what is done with it. Same size and layout as T: shared memory, the workspace and
// the parameter arrays hold it as they hold T.
template <typename T>
struct Acc {
  T v;
  struct Raw {};
  EMU_INLINE Acc(Raw, T x) : v(x) {}
  EMU_INLINE Acc() : v() { acc_fresh(this); }
  EMU_INLINE Acc(T x) : v(x) { acc_fresh(this); }  // NOLINT: converts like the float it stands for
  EMU_INLINE Acc(const Acc& o) : v(o.v) { acc_copy(this, &o); }
  EMU_INLINE Acc& operator=(const Acc& o) {
    v = o.v;
    acc_assign(this, &o);
    return *this;
  }
  EMU_INLINE operator T() const { return v; }  // NOLINT
};
static_assert(sizeof(Acc<float>) == sizeof(float) && sizeof(Acc<double>) == sizeof(double), "layout of T");

#define EMU_ACC_BINARY(sym, op)                                                 \
  template <typename T>                                                         \
  EMU_INLINE Acc<T> operator sym(const Acc<T>& a, const Acc<T>& b) {            \
    Acc<T> r(typename Acc<T>::Raw{}, a.v sym b.v);                              \
    acc_arith(&r, op, &a, &b);                                                  \
    return r;                                                                   \
  }                                                                             \
  template <typename T>                                                         \
  EMU_INLINE Acc<T>& operator sym##=(Acc<T>& a, const Acc<T>& b) { return a = a sym b; }
EMU_ACC_BINARY(+, '+')
EMU_ACC_BINARY(-, '-')
EMU_ACC_BINARY(*, '*')
#undef EMU_ACC_BINARY

template <typename T>
EMU_INLINE Acc<T> operator/(const Acc<T>& a, const Acc<T>& b) {
  Acc<T> r(typename Acc<T>::Raw{}, a.v / b.v);
  acc_div(&r, &a, &b, a.v == T(1));
  return r;
}
template <typename T>
EMU_INLINE Acc<T>& operator/=(Acc<T>& a, const Acc<T>& b) { return a = a / b; }
template <typename T>
EMU_INLINE Acc<T> operator-(const Acc<T>& a) {
  Acc<T> r(typename Acc<T>::Raw{}, -a.v);
  acc_neg(&r, &a);
  return r;
}
// Comparisons (not FMA-pipe work, not counted).
template <typename T> EMU_INLINE bool operator<(const Acc<T>& a, const Acc<T>& b) { return a.v < b.v; }
template <typename T> EMU_INLINE bool operator>(const Acc<T>& a, const Acc<T>& b) { return a.v > b.v; }
template <typename T> EMU_INLINE bool operator<=(const Acc<T>& a, const Acc<T>& b) { return a.v <= b.v; }
template <typename T> EMU_INLINE bool operator>=(const Acc<T>& a, const Acc<T>& b) { return a.v >= b.v; }

// The kernel's math on the accumulation type (found by argument-dependent lookup before its float overloads).
template <typename T>
EMU_INLINE Acc<T> ss_exp(const Acc<T>& x) {
  Acc<T> r(typename Acc<T>::Raw{}, std::exp(x.v));
  acc_sfu(&r, 'e', &x);
  return r;
}
template <typename T>
EMU_INLINE Acc<T> ss_exp2(const Acc<T>& x) {
  Acc<T> r(typename Acc<T>::Raw{}, std::exp2(x.v));
  acc_sfu(&r, 'e', &x);
  return r;
}
template <typename T>
EMU_INLINE Acc<T> ss_log1p(const Acc<T>& x) {
  Acc<T> r(typename Acc<T>::Raw{}, std::log1p(x.v));
  acc_sfu(&r, 'l', &x);
  return r;
}

// The kernel's read of a sum other blocks stored (load_fresh): a global load, so a fresh value (chain 0).
template <typename T>
EMU_INLINE Acc<T> load_fresh(const Acc<T>* p) {
  return Acc<T>(*reinterpret_cast<const volatile T*>(p));
}

// The kernel's rows of shared memory (smem_load / smem_store), more specialised than its templates, so that a row
// counts as the one access it is on a GPU rather than one per value (the values' own loads are not instrumented:
// they are made in emu_count.cpp).
template <int n, typename T>
EMU_INLINE void smem_load(const Acc<T>* p, Acc<T> (&out)[n]) {
  wide_load(out, p, n * sizeof(T), sizeof(T));
}
template <int n, typename T>
EMU_INLINE void smem_store(Acc<T>* p, const Acc<T> (&in)[n]) {
  wide_store(p, in, n * sizeof(T), sizeof(T));
}

}  // namespace emu

// The kernel's accumulation types in this build (csrc/selective_scan_kernel.cuh, AccType).
#define SS_ACC_FLOAT emu::Acc<float>
#define SS_ACC_DOUBLE emu::Acc<double>
