// Device code of the selective scan (Mamba's SSM scan), forward and backward.
//
// One source for NVIDIA (nvcc) and AMD (hipcc, after PyTorch's hipify). No torch, cub, hipcub or thrust headers:
// only the vendor runtime and its fp16/bf16 headers, behind the small compat layer below.
//
// The operation (see csrc/README.md), for batch b, channel d, state n, time t:
//   dl[b,d,t]  = softplus(delta[b,d,t] + delta_bias[d])          (bias and softplus optional)
//   h[b,d,n,t] = exp(dl*A[d,n]) * h[b,d,n,t-1] + dl * B[b,n,t] * u[b,d,t]      (h[-1] = 0)
//   y[b,d,t]   = sum_n h[b,d,n,t] * C[b,n,t] + D[d] * u[b,d,t]
//   out[b,d,t] = y * silu(z[b,d,t])                               (gate optional)
//
// ---------------------------------------------------------------------------------------------------------
// Work mapping (both kernels)
//   * A block (kThreads threads) owns one batch element b and `cpb` consecutive channels d0 .. d0+cpb-1.
//   * Each channel is owned by a "group" of G consecutive lanes, G = next power of two >= d_state, capped at
//     kSeg = 32. Lane g of a group holds the states n = g, g+G, g+2G, ... (kNPL "states per lane", a
//     template parameter, 1/2/4/8 so that d_state up to 256 fits). cpb = kThreads / G.
//   * Every thread runs the recurrence of its states sequentially over time. Sums over n (y, and in the
//     backward the gradients of u and delta) are xor-shuffle reductions inside the group.
//   * All shuffles use xor offsets < 32, so they never leave an aligned 32-lane segment: the same code is
//     correct for 32-wide NVIDIA warps and for 64-wide AMD wavefronts (a wavefront is simply two segments),
//     and even for wave32 AMD GPUs. The block size is a multiple of 64 so every warp/wavefront is full.
//   * Time is processed in chunks of T steps (T = "chunk length", <= 64, chosen by the host so that the
//     backward's shared memory stays under 48 KiB). Per chunk the block first stages the chunk's inputs in
//     shared memory with coalesced loads (converted to the accumulation type), then every thread steps
//     through the chunk reading only shared memory.
//
// Reverse mode (KernelParams::reverse, Vim's backward direction): the kernels walk scan steps s = 0, 1, ... as
//   always, and every global-memory index of a time-indexed tensor goes through p.time(s) = L-1-s. Chunks, stored
//   states and the arithmetic are those of the forward direction on flipped inputs, so no flipped copies are made
//   and out, du, ddelta, dz equal the flipped computation bit for bit.
//
// Forward: runs the recurrence; at the end of every chunk but the last it stores the state h into `saved`,
//   (batch, dim, n_chunks-1, N). So saved[b,d,c,:] is the state at the *start* of chunk c+1.
//
// Backward: walks the chunks from last to first. For chunk c it
//   1. stages u, dl, softplus', dy = dout*silu(z), dout*silu'(z), B, C of the chunk in shared memory;
//   2. recomputes the chunk's states from the stored state at its start (zero for chunk 0), keeping every
//      h_t of the chunk (and the start state) in a per-thread history in shared memory;
//   3. runs the reverse recurrence t = end .. start, with dh_t = C_t*dy_t + exp(dl_{t+1}A)*dh_{t+1} (the
//      second term is carried in registers, also across chunks):
//         du_t     = sum_n dh*dl*B + D*dy            ddl_t = sum_n dh*(A*exp(dl*A)*h_{t-1} + B*u)
//         dA[n]   += dh*dl*exp(dl*A)*h_{t-1}         dB_t[n] += dh*dl*u     dC_t[n] += h_t*dy
//         dz_t     = y_t * dout*silu'(z)             (y_t recomputed from the history)
//         ddelta_t = ddl_t * softplus'(delta+bias)   dD += dy*u      ddelta_bias += ddelta_t
//      dB and dC are sums over channels: first over the channels of a 32-lane segment (shuffles), then over
//      the block (shared-memory atomics), then over blocks (one global atomicAdd per block and element).
//      dA, dD, ddelta_bias are summed over time in registers and added to global memory once at the end.
// ---------------------------------------------------------------------------------------------------------
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(USE_ROCM)
#define SS_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
// hipify maps the CUDA bf16 header to hip/hip_bf16.h, which older ROCm releases (e.g. Debian's 5.2) lack;
// hip_bfloat16 from hip/hip_bfloat16.h exists across ROCm versions and has the same 16-bit layout as
// torch.bfloat16.
#include <hip/hip_bfloat16.h>
#else
#define SS_HIP 0
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

#include <stdint.h>

namespace ssk {

// ------------------------------------------------------------------ compat layer -------------------------

#if SS_HIP
using bf16_t = hip_bfloat16;
#else
using bf16_t = __nv_bfloat16;
#endif
using half_t = __half;

// Hardware warp size, for documentation and sanity checks only: the kernels never rely on it beyond
// "a multiple of 32" (see kSeg).
#if SS_HIP
#if defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
constexpr int kWarpSize = 64;  // host pass / AMD Instinct (CDNA) default
#endif
#else
constexpr int kWarpSize = 32;
#endif

// Reductions stay inside aligned segments of kSeg lanes (xor offsets < kSeg).
constexpr int kSeg = 32;
static_assert(kWarpSize % kSeg == 0, "the kernels assume a warp/wavefront is a whole number of 32-lane segments");

// Threads per block: a multiple of 64 so that blocks are made of whole warps (32) and whole wavefronts (64).
constexpr int kThreads = 128;
static_assert(kThreads % 64 == 0, "block must be whole warps and whole wavefronts");

// Longest chunk between two stored states.
constexpr int kMaxChunk = 64;

// Shared-memory budget per block (bytes): 48 KiB needs no opt-in on NVIDIA and fits AMD's 64 KiB LDS.
constexpr int kSmemBudget = 48 * 1024;

// Exchange with the lane whose index differs by `mask` (all lanes of the warp must call this together).
// HIP: __shfl_xor(v, mask, width = warpSize) takes no lane mask; it exists from ROCm 5 through ROCm 7. The
// *_sync variants that ROCm 6.2+ offers (default in ROCm 7) take a 64-bit lane mask: CUDA's 0xffffffff would name
// only lanes 0-31 of a wave64, so they are not used here. Lane ids are never taken as `threadIdx.x & 0x1f` (wrong
// on wave64, mamba_ssm's ROCm dA bug for L > 128): every cross-lane step has an xor offset < kSeg = 32, so partners
// lie in the same aligned 32-lane segment on 32- and 64-wide hardware alike. tools/kernel_emu runs this code both
// ways (CUDA branch with 32-lane warps, HIP branch with 64-lane wavefronts).
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
#if SS_HIP
  return __shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

// Accumulation type: double for double input, float otherwise.
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };

// Load an input element as the accumulation type, and store an accumulation value as the input type.
// Explicit intrinsics only: torch builds with __CUDA_NO_HALF_CONVERSIONS__ / __HIP_NO_HALF_CONVERSIONS__ etc.
__device__ __forceinline__ float load_acc(const float* p) { return *p; }
__device__ __forceinline__ double load_acc(const double* p) { return *p; }
__device__ __forceinline__ float load_acc(const half_t* p) { return __half2float(*p); }
#if SS_HIP
__device__ __forceinline__ float load_acc(const bf16_t* p) { return static_cast<float>(*p); }
#else
__device__ __forceinline__ float load_acc(const bf16_t* p) { return __bfloat162float(*p); }
#endif

__device__ __forceinline__ void store_from_acc(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_from_acc(double* p, double v) { *p = v; }
__device__ __forceinline__ void store_from_acc(half_t* p, float v) { *p = __float2half_rn(v); }
#if SS_HIP
__device__ __forceinline__ void store_from_acc(bf16_t* p, float v) { *p = bf16_t(v); }  // round to nearest even
#else
__device__ __forceinline__ void store_from_acc(bf16_t* p, float v) { *p = __float2bfloat16_rn(v); }
#endif

// Math in the accumulation type (overloads, so no std:: that hipify would rewrite).
__device__ __forceinline__ float ss_exp(float x) { return expf(x); }
__device__ __forceinline__ double ss_exp(double x) { return exp(x); }
__device__ __forceinline__ float ss_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double ss_log1p(double x) { return log1p(x); }

// torch.nn.functional.softplus with its defaults (beta 1, threshold 20): x above 20 passes through unchanged,
// and the derivative there is exactly 1.
template <typename T>
__device__ __forceinline__ T softplus(T x) {
  return x > T(20) ? x : ss_log1p(ss_exp(x));
}
// Written so that exp never overflows (matters under -ffast-math / --use_fast_math, which assume finite math).
template <typename T>
__device__ __forceinline__ T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + ss_exp(-x));
  const T e = ss_exp(x);
  return e / (T(1) + e);
}
template <typename T>
__device__ __forceinline__ T softplus_grad(T x) {
  return x > T(20) ? T(1) : sigmoid(x);
}

// Sum over the G lanes of a group (G a power of two <= kSeg, groups aligned): every lane gets the total.
template <typename T>
__device__ __forceinline__ T group_sum(T v, int G) {
  for (int off = G >> 1; off > 0; off >>= 1) v += shfl_xor(v, off);
  return v;
}

// Dynamic shared memory, declared once as double so that it is 8-byte aligned for float and double use.
extern __shared__ double ss_smem_raw[];

// ------------------------------------------------------------------ parameters -----------------------------

// What the kernels need, with 32-bit sizes (the launcher checks they fit). Pointers are untyped; each kernel
// casts them to its input / accumulation type.
struct KernelParams {
  int batch, dim, seqlen, dstate;
  int group;           // G: lanes per channel
  int chunk;           // T: time steps per chunk
  int n_chunks;        // ceil(seqlen / chunk)
  int blocks_per_batch;
  bool softplus;
  bool reverse;        // scan t = L-1 .. 0: step s of the scan is time L-1-s (see time())

  // Position in memory of scan step s: the kernels walk steps 0, 1, ...; in reverse mode they map to times L-1,
  // L-2, ..., so the reversed direction needs no flipped copies and runs exactly the forward's arithmetic.
  __host__ __device__ int time(int s) const { return reverse ? seqlen - 1 - s : s; }

  const void* u;
  const void* delta;
  const void* A;
  const void* B;
  const void* C;
  const void* D;           // may be null
  const void* z;           // may be null
  const void* delta_bias;  // may be null
  void* out;
  void* saved;             // (batch, dim, n_chunks-1, dstate), accumulation type
  const void* dout;
  void* du;
  void* ddelta;
  void* dz;                // null iff z is null
  void* dA;                // accumulation type, zero-initialised, atomically accumulated
  void* dB;
  void* dC;
  void* dD;                // null iff D is null
  void* ddelta_bias;       // null iff delta_bias is null
};

// Shared-memory sizes (in elements of the accumulation type); the host uses the same formulas.
__host__ __device__ inline int64_t fwd_smem_elems(int chunk, int dstate, int group) {
  const int cpb = kThreads / group;
  // u, dl, y per channel and step; B, C per state and step
  return int64_t(3) * chunk * cpb + int64_t(2) * chunk * dstate;
}
__host__ __device__ inline int64_t bwd_smem_elems(int chunk, int dstate, int group, int npl) {
  const int cpb = kThreads / group;
  // history of chunk+1 states per thread and state slot; 5 staged + 3 output values per channel and step;
  // B, C, dB, dC per state and step
  return int64_t(chunk + 1) * kThreads * npl + int64_t(8) * chunk * cpb + int64_t(4) * chunk * dstate;
}

// Which (batch, channel, lane) a thread works on.
struct ThreadMap {
  int b, d0, c_local, lane_g, d;
  bool ch_ok;
  __device__ ThreadMap(const KernelParams& p) {
    const int cpb = kThreads / p.group;
    b = blockIdx.x / p.blocks_per_batch;
    d0 = (blockIdx.x % p.blocks_per_batch) * cpb;
    c_local = threadIdx.x / p.group;
    lane_g = threadIdx.x % p.group;
    d = d0 + c_local;
    ch_ok = d < p.dim;
  }
};

// ------------------------------------------------------------------ forward --------------------------------

template <typename input_t, int kNPL>
__global__ void __launch_bounds__(kThreads) scan_fwd_kernel(const KernelParams p) {
  using acc_t = typename AccType<input_t>::type;
  const int N = p.dstate, L = p.seqlen, T = p.chunk, G = p.group;
  const int cpb = kThreads / G;
  const int tid = threadIdx.x;
  const ThreadMap m(p);

  const input_t* __restrict__ u = static_cast<const input_t*>(p.u);
  const input_t* __restrict__ delta = static_cast<const input_t*>(p.delta);
  const input_t* __restrict__ Bg = static_cast<const input_t*>(p.B);
  const input_t* __restrict__ Cg = static_cast<const input_t*>(p.C);
  const input_t* __restrict__ z = static_cast<const input_t*>(p.z);
  const acc_t* __restrict__ Ag = static_cast<const acc_t*>(p.A);
  const acc_t* __restrict__ Dg = static_cast<const acc_t*>(p.D);
  const acc_t* __restrict__ bias = static_cast<const acc_t*>(p.delta_bias);
  input_t* __restrict__ out = static_cast<input_t*>(p.out);
  acc_t* __restrict__ saved = static_cast<acc_t*>(p.saved);

  // Shared memory: per-channel arrays are [t][channel] and per-state arrays [t][n], so that in the time loop
  // the lanes of a warp read consecutive addresses (no bank conflicts) or the same one (broadcast).
  acc_t* smem = reinterpret_cast<acc_t*>(ss_smem_raw);
  acc_t* u_s = smem;            // [T][cpb]
  acc_t* dl_s = u_s + T * cpb;  // [T][cpb]  delta after bias and softplus
  acc_t* y_s = dl_s + T * cpb;  // [T][cpb]  y before gating
  acc_t* B_s = y_s + T * cpb;   // [T][N]
  acc_t* C_s = B_s + T * N;     // [T][N]

  // This lane's states: n = k*G + lane_g.
  acc_t A[kNPL], h[kNPL];
  bool n_ok[kNPL];
#pragma unroll
  for (int k = 0; k < kNPL; ++k) {
    const int n = k * G + m.lane_g;
    n_ok[k] = m.ch_ok && n < N;
    A[k] = n_ok[k] ? Ag[int64_t(m.d) * N + n] : acc_t(0);
    h[k] = acc_t(0);
  }
  const acc_t D_d = (Dg != nullptr && m.ch_ok) ? Dg[m.d] : acc_t(0);
  const int64_t n_ckpt = p.n_chunks - 1;

  for (int c = 0; c < p.n_chunks; ++c) {
    const int t0 = c * T;
    const int len = min(T, L - t0);

    __syncthreads();  // everybody is done with the previous chunk (cheap: once per chunk)

    // Stage the chunk. Consecutive threads take consecutive time steps: coalesced global loads.
    for (int i = tid; i < cpb * T; i += kThreads) {
      const int cl = i / T, t = i % T, dd = m.d0 + cl;
      acc_t uv = acc_t(0), dv = acc_t(0);
      if (dd < p.dim && t < len) {
        const int64_t off = (int64_t(m.b) * p.dim + dd) * L + p.time(t0 + t);
        uv = load_acc(u + off);
        dv = load_acc(delta + off);
        if (bias != nullptr) dv += bias[dd];
        if (p.softplus) dv = softplus(dv);
      }
      u_s[t * cpb + cl] = uv;
      dl_s[t * cpb + cl] = dv;
    }
    for (int i = tid; i < N * T; i += kThreads) {
      const int n = i / T, t = i % T;
      acc_t bv = acc_t(0), cv = acc_t(0);
      if (t < len) {
        const int64_t off = (int64_t(m.b) * N + n) * L + p.time(t0 + t);
        bv = load_acc(Bg + off);
        cv = load_acc(Cg + off);
      }
      B_s[t * N + n] = bv;
      C_s[t * N + n] = cv;
    }
    __syncthreads();

    // The recurrence. Every lane runs every step (the shuffles need all lanes); lanes without a valid state
    // contribute 0.
    for (int t = 0; t < len; ++t) {
      const acc_t dl = dl_s[t * cpb + m.c_local];
      const acc_t uv = u_s[t * cpb + m.c_local];
      const acc_t dlu = dl * uv;
      acc_t y = acc_t(0);
#pragma unroll
      for (int k = 0; k < kNPL; ++k) {
        if (n_ok[k]) {
          const int n = k * G + m.lane_g;
          h[k] = ss_exp(dl * A[k]) * h[k] + dlu * B_s[t * N + n];
          y += h[k] * C_s[t * N + n];
        }
      }
      y = group_sum(y, G);
      if (m.lane_g == 0) y_s[t * cpb + m.c_local] = y + D_d * uv;
    }

    // Checkpoint: the state at the start of the next chunk.
    if (c + 1 < p.n_chunks) {
#pragma unroll
      for (int k = 0; k < kNPL; ++k) {
        if (n_ok[k]) saved[((int64_t(m.b) * p.dim + m.d) * n_ckpt + c) * N + k * G + m.lane_g] = h[k];
      }
    }
    __syncthreads();  // y_s complete

    // Epilogue: gate and store, coalesced.
    for (int i = tid; i < cpb * T; i += kThreads) {
      const int cl = i / T, t = i % T, dd = m.d0 + cl;
      if (dd < p.dim && t < len) {
        const int64_t off = (int64_t(m.b) * p.dim + dd) * L + p.time(t0 + t);
        acc_t y = y_s[t * cpb + cl];
        if (z != nullptr) {
          const acc_t zv = load_acc(z + off);
          y *= zv * sigmoid(zv);
        }
        store_from_acc(out + off, y);
      }
    }
  }
}

// ------------------------------------------------------------------ backward -------------------------------

template <typename input_t, int kNPL>
__global__ void __launch_bounds__(kThreads) scan_bwd_kernel(const KernelParams p) {
  using acc_t = typename AccType<input_t>::type;
  const int N = p.dstate, L = p.seqlen, T = p.chunk, G = p.group;
  const int cpb = kThreads / G;
  const int tid = threadIdx.x;
  const ThreadMap m(p);

  const input_t* __restrict__ u = static_cast<const input_t*>(p.u);
  const input_t* __restrict__ delta = static_cast<const input_t*>(p.delta);
  const input_t* __restrict__ Bg = static_cast<const input_t*>(p.B);
  const input_t* __restrict__ Cg = static_cast<const input_t*>(p.C);
  const input_t* __restrict__ z = static_cast<const input_t*>(p.z);
  const input_t* __restrict__ dout = static_cast<const input_t*>(p.dout);
  const acc_t* __restrict__ Ag = static_cast<const acc_t*>(p.A);
  const acc_t* __restrict__ Dg = static_cast<const acc_t*>(p.D);
  const acc_t* __restrict__ bias = static_cast<const acc_t*>(p.delta_bias);
  const acc_t* __restrict__ saved = static_cast<const acc_t*>(p.saved);
  input_t* __restrict__ du = static_cast<input_t*>(p.du);
  input_t* __restrict__ ddelta = static_cast<input_t*>(p.ddelta);
  input_t* __restrict__ dz = static_cast<input_t*>(p.dz);
  acc_t* __restrict__ dA = static_cast<acc_t*>(p.dA);
  acc_t* __restrict__ dB = static_cast<acc_t*>(p.dB);
  acc_t* __restrict__ dC = static_cast<acc_t*>(p.dC);
  acc_t* __restrict__ dD = static_cast<acc_t*>(p.dD);
  acc_t* __restrict__ dbias = static_cast<acc_t*>(p.ddelta_bias);

  // Shared memory layout (see bwd_smem_elems).
  constexpr int kSlots = kThreads * kNPL;  // state slots per block; slot of (thread, k) = k*kThreads + tid
  acc_t* smem = reinterpret_cast<acc_t*>(ss_smem_raw);
  acc_t* hist = smem;                         // [T+1][kSlots]: hist[j] = state after step t0+j-1
  acc_t* u_s = hist + (T + 1) * kSlots;       // [T][cpb]
  acc_t* dl_s = u_s + T * cpb;                // [T][cpb]  delta after bias and softplus
  acc_t* dsp_s = dl_s + T * cpb;              // [T][cpb]  d dl / d(delta+bias)
  acc_t* dy_s = dsp_s + T * cpb;              // [T][cpb]  dL/dy = dout * silu(z)
  acc_t* gz_s = dy_s + T * cpb;               // [T][cpb]  dout * silu'(z), so dz = y * gz
  acc_t* du_o = gz_s + T * cpb;               // [T][cpb]  outputs, stored after the chunk
  acc_t* ddl_o = du_o + T * cpb;              // [T][cpb]
  acc_t* dz_o = ddl_o + T * cpb;              // [T][cpb]
  acc_t* B_s = dz_o + T * cpb;                // [T][N]
  acc_t* C_s = B_s + T * N;                   // [T][N]
  acc_t* dB_s = C_s + T * N;                  // [T][N]  block's sum over its channels
  acc_t* dC_s = dB_s + T * N;                 // [T][N]

  acc_t A[kNPL], carry[kNPL], dA_acc[kNPL];
  bool n_ok[kNPL];
#pragma unroll
  for (int k = 0; k < kNPL; ++k) {
    const int n = k * G + m.lane_g;
    n_ok[k] = m.ch_ok && n < N;
    A[k] = n_ok[k] ? Ag[int64_t(m.d) * N + n] : acc_t(0);
    carry[k] = acc_t(0);  // exp(dl_{t+1} A) * dh_{t+1}: the gradient reaching h_t through h_{t+1}
    dA_acc[k] = acc_t(0);
  }
  const acc_t D_d = (Dg != nullptr && m.ch_ok) ? Dg[m.d] : acc_t(0);
  acc_t dD_acc = acc_t(0), dbias_acc = acc_t(0);  // meaningful on lane_g == 0
  const int64_t n_ckpt = p.n_chunks - 1;
  const bool seg_leader = (tid % kSeg) < G;  // first group of its 32-lane segment

  for (int c = p.n_chunks - 1; c >= 0; --c) {
    const int t0 = c * T;
    const int len = min(T, L - t0);

    // The previous (later) chunk's epilogue must be done with the shared arrays before they are restaged. (Today
    // each thread would only overwrite dB_s / dC_s entries it read itself, but the phases stay independent.)
    __syncthreads();

    // ---- 1. stage the chunk (zeros outside the sequence and for channels past dim)
    for (int i = tid; i < cpb * T; i += kThreads) {
      const int cl = i / T, t = i % T, dd = m.d0 + cl;
      acc_t uv = acc_t(0), dl = acc_t(0), dsp = acc_t(0), dy = acc_t(0), gz = acc_t(0);
      if (dd < p.dim && t < len) {
        const int64_t off = (int64_t(m.b) * p.dim + dd) * L + p.time(t0 + t);
        uv = load_acc(u + off);
        acc_t raw = load_acc(delta + off);
        if (bias != nullptr) raw += bias[dd];
        dl = p.softplus ? softplus(raw) : raw;
        dsp = p.softplus ? softplus_grad(raw) : acc_t(1);
        const acc_t g = load_acc(dout + off);
        if (z != nullptr) {
          const acc_t zv = load_acc(z + off);
          const acc_t sg = sigmoid(zv);
          dy = g * zv * sg;                                 // dout * silu(z)
          gz = g * sg * (acc_t(1) + zv * (acc_t(1) - sg));  // dout * silu'(z)
        } else {
          dy = g;
        }
      }
      const int s = t * cpb + cl;
      u_s[s] = uv;
      dl_s[s] = dl;
      dsp_s[s] = dsp;
      dy_s[s] = dy;
      gz_s[s] = gz;
    }
    for (int i = tid; i < N * T; i += kThreads) {
      const int n = i / T, t = i % T;
      acc_t bv = acc_t(0), cv = acc_t(0);
      if (t < len) {
        const int64_t off = (int64_t(m.b) * N + n) * L + p.time(t0 + t);
        bv = load_acc(Bg + off);
        cv = load_acc(Cg + off);
      }
      B_s[t * N + n] = bv;
      C_s[t * N + n] = cv;
      dB_s[t * N + n] = acc_t(0);
      dC_s[t * N + n] = acc_t(0);
    }
    __syncthreads();

    // ---- 2. recompute the chunk's states from the stored start state, with the same operations as the
    // forward. Each thread only touches its own history slots, so no barrier is needed before step 3.
    {
      acc_t h[kNPL];
#pragma unroll
      for (int k = 0; k < kNPL; ++k) {
        h[k] = (c > 0 && n_ok[k])
                   ? saved[((int64_t(m.b) * p.dim + m.d) * n_ckpt + (c - 1)) * N + k * G + m.lane_g]
                   : acc_t(0);
        hist[k * kThreads + tid] = h[k];
      }
      for (int t = 0; t < len; ++t) {
        const acc_t dl = dl_s[t * cpb + m.c_local];
        const acc_t dlu = dl * u_s[t * cpb + m.c_local];
#pragma unroll
        for (int k = 0; k < kNPL; ++k) {
          if (n_ok[k]) h[k] = ss_exp(dl * A[k]) * h[k] + dlu * B_s[t * N + k * G + m.lane_g];
          hist[(t + 1) * kSlots + k * kThreads + tid] = h[k];
        }
      }
    }

    // ---- 3. reverse recurrence over the chunk
    for (int t = len - 1; t >= 0; --t) {
      const int s = t * cpb + m.c_local;
      const acc_t dl = dl_s[s];
      const acc_t uv = u_s[s];
      const acc_t dy = dy_s[s];
      acc_t y_p = acc_t(0), ddl_p = acc_t(0), du_p = acc_t(0);  // this lane's part of the sums over n
#pragma unroll
      for (int k = 0; k < kNPL; ++k) {
        const int n = k * G + m.lane_g;
        acc_t dB_v = acc_t(0), dC_v = acc_t(0);
        if (n_ok[k]) {
          const acc_t Bv = B_s[t * N + n];
          const acc_t Cv = C_s[t * N + n];
          const acc_t h_prev = hist[t * kSlots + k * kThreads + tid];
          const acc_t h_cur = hist[(t + 1) * kSlots + k * kThreads + tid];
          const acc_t a = ss_exp(dl * A[k]);
          const acc_t dh = carry[k] + Cv * dy;  // total gradient of h_t
          y_p += h_cur * Cv;
          dB_v = dh * dl * uv;
          dC_v = h_cur * dy;
          ddl_p += dh * (A[k] * a * h_prev + Bv * uv);
          du_p += dh * dl * Bv;
          dA_acc[k] += dh * dl * a * h_prev;
          carry[k] = a * dh;
        }
        // Sum dB, dC over the channels sharing this 32-lane segment (lanes with the same lane_g), then the
        // segment's first group adds them into the block's shared sums.
        for (int off = G; off < kSeg; off <<= 1) {
          dB_v += shfl_xor(dB_v, off);
          dC_v += shfl_xor(dC_v, off);
        }
        if (seg_leader && n < N) {
          atomicAdd(&dB_s[t * N + n], dB_v);
          atomicAdd(&dC_s[t * N + n], dC_v);
        }
      }
      y_p = group_sum(y_p, G);
      ddl_p = group_sum(ddl_p, G);
      du_p = group_sum(du_p, G);
      if (m.lane_g == 0) {  // zeros for channels past dim (all staged values are 0 there)
        const acc_t y = y_p + D_d * uv;
        const acc_t ddelta_t = ddl_p * dsp_s[s];
        dz_o[s] = y * gz_s[s];
        du_o[s] = du_p + D_d * dy;
        ddl_o[s] = ddelta_t;
        dD_acc += dy * uv;
        dbias_acc += ddelta_t;
      }
    }
    __syncthreads();  // outputs and dB_s / dC_s complete

    // ---- 4. write the chunk's gradients, coalesced
    for (int i = tid; i < cpb * T; i += kThreads) {
      const int cl = i / T, t = i % T, dd = m.d0 + cl;
      if (dd < p.dim && t < len) {
        const int64_t off = (int64_t(m.b) * p.dim + dd) * L + p.time(t0 + t);
        const int s = t * cpb + cl;
        store_from_acc(du + off, du_o[s]);
        store_from_acc(ddelta + off, ddl_o[s]);
        if (dz != nullptr) store_from_acc(dz + off, dz_o[s]);
      }
    }
    for (int i = tid; i < N * T; i += kThreads) {
      const int n = i / T, t = i % T;
      if (t < len) {
        const int64_t off = (int64_t(m.b) * N + n) * L + p.time(t0 + t);
        atomicAdd(dB + off, dB_s[t * N + n]);
        atomicAdd(dC + off, dC_s[t * N + n]);
      }
    }
  }

  // Parameters' gradients: summed over time here, over batch (and for dA nothing else) by the atomics.
#pragma unroll
  for (int k = 0; k < kNPL; ++k) {
    if (n_ok[k]) atomicAdd(dA + int64_t(m.d) * N + k * G + m.lane_g, dA_acc[k]);
  }
  if (m.lane_g == 0 && m.ch_ok) {
    if (dD != nullptr) atomicAdd(dD + m.d, dD_acc);
    if (dbias != nullptr) atomicAdd(dbias + m.d, dbias_acc);
  }
}

}  // namespace ssk
