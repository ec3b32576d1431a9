// CPU stand-in for the CUDA runtime, just enough to run the selective-scan kernels on the host: every GPU thread
// of a block is a coroutine; __syncthreads() and warp shuffles are the only switch points. Blocks run one after
// another. Used only by tools/kernel_emu (never by a real build). With EMU_COUNT (the counting build) it also reports
// every launch, barrier, shuffle and round of the scheduler to emu_count.cpp (emu_count.h).
#pragma once
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#if defined(EMU_COUNT)
#include "emu_count.h"
// Inlined for certain, so that each access of global memory is counted at its call site in the kernel.
#define __forceinline__ EMU_INLINE
#define EMU_COUNT_HOOK(...) __VA_ARGS__
#else
#define __forceinline__ inline
#define EMU_COUNT_HOOK(...)
#endif
#define __launch_bounds__(...)
#define __shared__

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
typedef struct CUstream_st* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorLaunchFailure = 4, cudaErrorInvalidConfiguration = 9 };

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace emu {

struct Config {
  int order_mode = 0;        // 0: threads ascending, 1: descending, 2: random order every round
  unsigned seed = 1;
  int guard_front = 0;       // 0: guard page after each buffer (catches overruns), 1: before (underruns)
  size_t smem_limit = 48 * 1024;
  int warp = 32;
};
inline Config& config() { static Config c; return c; }

struct Error {
  cudaError_t code = cudaSuccess;
  std::string msg;
};
inline Error& error() { static Error e; return e; }
[[noreturn]] inline void fatal(const std::string& m) {
  std::fprintf(stderr, "EMU FATAL: %s\n", m.c_str());
  std::abort();
}

// Buffer with a PROT_NONE page right after its end (or right before its start): out-of-bounds access segfaults.
struct Guarded {
  void* base = nullptr;
  size_t total = 0;
  void* ptr = nullptr;
  Guarded() = default;
  // align: of the start when the guard is behind (the buffer then ends up to align - 1 bytes short of it)
  explicit Guarded(size_t bytes, size_t align = 1) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t data_pages = (bytes + page - 1) / page + 1;
    total = (data_pages + 1) * page;
    base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) fatal("mmap");
    char* b = static_cast<char*>(base);
    if (config().guard_front) {
      mprotect(b, page, PROT_NONE);
      ptr = b + page;
    } else {
      mprotect(b + data_pages * page, page, PROT_NONE);
      ptr = b + ((data_pages * page - bytes) & ~(align - 1));
    }
  }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  Guarded(Guarded&& o) noexcept { *this = std::move(o); }
  Guarded& operator=(Guarded&& o) noexcept {
    std::swap(base, o.base);
    std::swap(total, o.total);
    std::swap(ptr, o.ptr);
    return *this;
  }
  ~Guarded() {
    if (base) munmap(base, total);
  }
};

// A coroutine's saved context. On x86-64, a switch saves the callee-saved registers and the floating-point control
// words on the old stack and loads the new stack pointer: glibc's swapcontext also saves the whole FPU state and
// makes an rt_sigprocmask system call at every switch, which was two thirds of the emulator's run time (perf).
// Elsewhere ucontext does it.
#if defined(__x86_64__)
extern "C" void vim_ds_emu_switch(void** save_sp, void* load_sp);
asm(R"(
        .text
        .p2align 4
        .hidden vim_ds_emu_switch
        .globl vim_ds_emu_switch
        .type vim_ds_emu_switch, @function
vim_ds_emu_switch:
        pushq %rbp
        pushq %rbx
        pushq %r12
        pushq %r13
        pushq %r14
        pushq %r15
        subq $8, %rsp
        stmxcsr (%rsp)
        fnstcw 4(%rsp)
        movq %rsp, (%rdi)
        movq %rsi, %rsp
        ldmxcsr (%rsp)
        fldcw 4(%rsp)
        addq $8, %rsp
        popq %r15
        popq %r14
        popq %r13
        popq %r12
        popq %rbx
        popq %rbp
        ret
        .size vim_ds_emu_switch, .-vim_ds_emu_switch
)");
struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) { vim_ds_emu_switch(&from.sp, to.sp); }
// A fresh context whose first switch "returns" into entry() at the top of `stack`, aligned as after a call.
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15);
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = 0;                                    // entry()'s return address: it never returns
  *--slot = reinterpret_cast<uint64_t>(entry);    // where the switch's ret goes
  for (int i = 0; i < 6; ++i) *--slot = 0;        // rbp, rbx, r12-r15
  *--slot = 0x037Full << 32 | 0x1F80u;            // x87 control word, MXCSR: the ABI's initial values
  c.sp = slot;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

enum State { RUNNING, AT_SYNC, AT_SHFL, DONE };
struct Thread {
  Context ctx;
  int tid = 0;
  State state = RUNNING;
  double val = 0, res = 0;
  int lanemask = 0;
};
struct Sched {
  Context main_ctx;
  Thread* cur = nullptr;
  dim3 block_idx, block_dim, grid_dim;
  std::function<void()> body;
  double** smem_slot = nullptr;  // where the kernel's dynamic shared memory pointer lives
  long long sync_points = 0;
};
inline Sched& sched() { static Sched s; return s; }

inline void yield(State st) {
  Thread* t = sched().cur;
  t->state = st;
  switch_context(t->ctx, sched().main_ctx);
}

inline void trampoline() {
  sched().body();
  sched().cur->state = DONE;
  switch_context(sched().cur->ctx, sched().main_ctx);
  fatal("resumed a finished thread");
}

// The threads' stacks, kept from block to block: allocating (and zeroing) 256 KiB per thread for every block
// made the kernel's page faults, not the kernel, most of the emulator's run time.
constexpr size_t kStackBytes = 256 * 1024;
inline char* thread_stack(int i) {
  static std::vector<std::unique_ptr<char[]>> stacks;
  while (int(stacks.size()) <= i) stacks.emplace_back(new char[kStackBytes]);
  return stacks[i].get();
}

inline void run_block(int nthreads) {
  Sched& s = sched();
  std::vector<Thread> th(nthreads);
  for (int i = 0; i < nthreads; ++i) {
    th[i].tid = i;
    make_context(th[i].ctx, thread_stack(i), kStackBytes, trampoline);
  }
  std::vector<int> order(nthreads);
  for (int i = 0; i < nthreads; ++i) order[i] = config().order_mode == 1 ? nthreads - 1 - i : i;
  std::mt19937 rng(config().seed + 7919u * s.block_idx.x);
  const int W = config().warp;
  for (;;) {
    if (config().order_mode == 2) std::shuffle(order.begin(), order.end(), rng);
    for (int i : order) {
      if (th[i].state != RUNNING) continue;
      s.cur = &th[i];
      EMU_COUNT_HOOK(count_lane(i));
      switch_context(s.main_ctx, th[i].ctx);
    }
    s.cur = nullptr;
    EMU_COUNT_HOOK(count_lane(-1));
    EMU_COUNT_HOOK(count_round_end());
    int n_done = 0, n_sync = 0, n_shfl = 0;
    for (auto& t : th) {
      n_done += t.state == DONE;
      n_sync += t.state == AT_SYNC;
      n_shfl += t.state == AT_SHFL;
    }
    if (n_done == nthreads) break;
    ++s.sync_points;
    if (n_sync == nthreads) {
      EMU_COUNT_HOOK(count_barrier());
      for (auto& t : th) t.state = RUNNING;
      continue;
    }
    if (n_shfl == nthreads) {
      EMU_COUNT_HOOK(count_shuffle(nthreads / W));
      for (int w = 0; w < nthreads / W; ++w) {
        for (int l = 0; l < W; ++l) {
          const Thread& me = th[w * W + l];
          if (me.lanemask != th[w * W].lanemask) fatal("lanes of a warp shuffle with different offsets");
          const int partner = l ^ me.lanemask;
          if (partner >= W) fatal("shuffle partner outside the warp");
        }
        for (int l = 0; l < W; ++l) {
          th[w * W + l].res = th[w * W + (l ^ th[w * W + l].lanemask)].val;
          EMU_COUNT_HOOK(count_shuffle_pair(w * W + l, w * W + (l ^ th[w * W + l].lanemask)));
        }
      }
      for (auto& t : th) t.state = RUNNING;
      continue;
    }
    fatal("divergent synchronisation: done=" + std::to_string(n_done) + " syncthreads=" + std::to_string(n_sync) +
          " shuffle=" + std::to_string(n_shfl) + " of " + std::to_string(nthreads));
  }
}

// The pass of a multi-pass launch, for the counting build's report (-1: the parameters have none).
template <typename Params>
auto launch_pass(const Params& p, int) -> decltype(int(p.pass)) {
  return p.pass;
}
template <typename Params>
int launch_pass(const Params&, long) {
  return -1;
}

template <typename Kernel, typename Params>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t, const Params& params) {
  Sched& s = sched();
  if (grid.x == 0 || block.x == 0 || block.x % config().warp != 0 || smem > config().smem_limit) {
    error().code = cudaErrorInvalidConfiguration;
    error().msg = "invalid configuration (grid " + std::to_string(grid.x) + ", block " + std::to_string(block.x) +
                  ", smem " + std::to_string(smem) + ")";
    return;
  }
  if (s.smem_slot == nullptr) fatal("smem slot not registered");
  // 16-byte aligned, as a GPU's shared memory is (the kernels' rows of 16 bytes, smem_load): with the guard behind,
  // an overrun of up to 15 bytes past the end goes unseen (the run with the guard in front is exact)
  Guarded sm(smem, 16);
  s.grid_dim = grid;
  s.block_dim = block;
  const Params p = params;
  s.body = [&]() { kernel(p); };
  std::vector<unsigned> blocks(grid.x);
  for (unsigned b = 0; b < grid.x; ++b) blocks[b] = b;
  if (config().order_mode == 1) std::reverse(blocks.begin(), blocks.end());
  if (config().order_mode == 2) std::shuffle(blocks.begin(), blocks.end(), std::mt19937(config().seed));
  EMU_COUNT_HOOK(count_smem(sm.ptr, smem));
  EMU_COUNT_HOOK(count_launch_begin(reinterpret_cast<const void*>(kernel), launch_pass(params, 0), grid.x, block.x,
                                    config().warp));
  for (unsigned b : blocks) {
    std::memset(sm.ptr, 0xff, smem);  // NaN for float and double: reading shared memory never written shows
    *s.smem_slot = static_cast<double*>(sm.ptr);
    s.block_idx = dim3(b);
    EMU_COUNT_HOOK(count_block_begin(b));
    run_block(int(block.x));
    EMU_COUNT_HOOK(count_block_end());
  }
  EMU_COUNT_HOOK(count_launch_end());
}

}  // namespace emu

#define threadIdx (::dim3(unsigned(emu::sched().cur->tid)))
#define blockIdx (emu::sched().block_idx)
#define blockDim (emu::sched().block_dim)
#define gridDim (emu::sched().grid_dim)

inline void __syncthreads() { emu::yield(emu::AT_SYNC); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lanemask, int width = 32) {
  if (mask != 0xffffffffu || width != 32) emu::fatal("unexpected shuffle mask/width");
  emu::Thread* t = emu::sched().cur;
  t->val = double(v);
  t->lanemask = lanemask;
  emu::yield(emu::AT_SHFL);
  return T(t->res);
}
#if defined(EMU_COUNT)
// An accumulation value crosses lanes with its shadow (emu_count.h).
template <typename T>
inline emu::Acc<T> __shfl_xor_sync(unsigned mask, emu::Acc<T> v, int lanemask, int width = 32) {
  emu::acc_shfl_send(&v);
  emu::Acc<T> r(__shfl_xor_sync(mask, v.v, lanemask, width));
  emu::acc_shfl_recv(&r);
  return r;
}
#endif

// One OS thread runs everything, so plain read-modify-write is atomic here, and every store is seen at once. (The
// kernels use integer atomics only: the backward's chain, see csrc/selective_scan_kernel.cuh.)
// (The counting build's race check is told which accesses are an atomic's, and that an exchange is a release.)
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  EMU_COUNT_HOOK(emu::race_atomic(1, emu::sched().cur->tid));
  const unsigned o = *p;
  *p = o + v;
  EMU_COUNT_HOOK(emu::race_atomic(0, 0));
  return o;
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
  EMU_COUNT_HOOK(emu::race_atomic(2, emu::sched().cur->tid));
  const unsigned o = *p;
  *p = v;
  EMU_COUNT_HOOK(emu::race_atomic(0, 0));
  return o;
}
inline void __threadfence() {}
// A lane waiting for another block (the backward's chain): blocks run one after another here, so a wait that is
// not over at once waits for a block that has not run. On a GPU that can hang (the blocks it waits for need not
// have started), so it is a failure.
inline void __nanosleep(unsigned) { emu::fatal("a block waits for a block that has not run (the kernel would hang)"); }

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::error().code;
  emu::error().code = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t) { return emu::error().msg.c_str(); }
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
