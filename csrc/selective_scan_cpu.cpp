// CPU selective scan: forward and backward of the recurrence in csrc/README.md.
//
// Layout of the work
//   * One (batch b, channel d) pair is one independent scan over time with a state vector of d_state (N)
//     floats. The per-channel routines `scan_channel_fwd` / `scan_channel_bwd` hold all of the math; everything
//     else is plumbing (dtype conversion, threading, reductions over channels/batch).
//   * The inner loop runs over the state index n, so it is vectorised (N = 16 in Vision Mamba); B and C are
//     transposed once to (batch, L, N) in the accumulation type so that this loop reads contiguous memory.
//   * The backward recomputes the forward states of its channel into a thread-local L x N buffer (cheap next to
//     the reverse pass) instead of saving anything from the forward, so `saved` is an empty tensor.
//   * Threads split the (batch, channel) pairs with at::parallel_for (so torch.set_num_threads applies).
//     Quantities that sum over channels (dB, dC) or over the batch (dA, dD, ddelta_bias) go into partial buffers
//     that belong to a fixed work item, never to a thread, and are summed in a fixed order at the end: results
//     are bitwise reproducible and independent of the number of threads.
//   * On x86-64 the hot code is compiled twice, for baseline x86-64 and for AVX2+FMA, and picked at run time
//     (the binary must not require AVX2). Elsewhere (aarch64) the compiler's baseline vector ISA is used.
//
// Precision: state and accumulation in float32 (float64 for float64 input). float32/bfloat16 use a polynomial
// exp / log1p (a few ulp, written to be vectorisable); float64 uses std::exp / std::log1p so it can be checked
// against the reference to ~1e-12.

#include "selective_scan_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__GNUC__) || defined(__clang__)
#define SCAN_INLINE inline __attribute__((always_inline))
#define SCAN_PRAGMA(x) _Pragma(#x)
#else
#define SCAN_INLINE inline
#define SCAN_PRAGMA(x)
#endif

// `omp simd` lets the compiler vectorise the loops over the state index, including the sums over n (which it
// would otherwise refuse to reorder). It only needs -fopenmp or -fopenmp-simd; without either it is ignored.
#define SCAN_SIMD SCAN_PRAGMA(omp simd)
#define SCAN_SIMD_SUM(...) SCAN_PRAGMA(omp simd reduction(+ : __VA_ARGS__))

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SCAN_X86_DISPATCH 1
#define SCAN_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define SCAN_X86_DISPATCH 0
#endif

namespace vim_ds {
namespace scan_cpu {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Scalar math. Overloaded on the accumulation type: float gets branch-free polynomial versions that vectorise
// inside the n-loops (std::exp would be a scalar libm call per element); double keeps the libm functions.
// ---------------------------------------------------------------------------------------------------------------

SCAN_INLINE float bits_to_float(int32_t i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

// exp(x) for float: x = k ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 polynomial (Cephes coefficients),
// 2^k built in the exponent bits. Max error ~1-2 ulp. Below about -87.3 the result would be subnormal; we return
// 0 there (the decay exp(delta * A) only multiplies the state, so this is harmless). NaN propagates.
SCAN_INLINE float exp_f32(float x) {
  constexpr float kLo = -87.3f, kHi = 88.3f;
  float xc = x < kLo ? kLo : x;
  xc = xc > kHi ? kHi : xc;
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (exact for |k| < 2^22; vectorises without
  // needing SSE4.1 round instructions).
  constexpr float kMagic = 12582912.0f;
  float k = xc * 1.44269504088896341f + kMagic;
  k -= kMagic;
  // Cody-Waite: ln2 split into a part exact in float and a small correction, so r keeps full precision.
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const float scale = bits_to_float((static_cast<int32_t>(k) + 127) << 23);  // 2^k, k in [-126, 127]
  const float res = p * scale;
  return x < kLo ? 0.0f : res;
}

// log1p(e) for float, e in [0, 1] (all softplus needs). log(w) for w = 1 + e by the Cephes logf polynomial, plus
// the classic correction (e - (w - 1)) / w for the rounding of 1 + e, which keeps tiny e accurate.
SCAN_INLINE float log1p_unit_f32(float e) {
  const float w = 1.0f + e;
  const bool hi = w > 1.41421356f;  // bring the argument to [sqrt(1/2), sqrt(2)): log(w) = k ln2 + log(m)
  const float m = hi ? 0.5f * w : w;
  const float k = hi ? 1.0f : 0.0f;
  const float f = m - 1.0f;  // exact
  const float f2 = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  float y = f * f2 * p + k * -2.12194440e-4f;
  y = y - 0.5f * f2;
  const float logw = f + y + k * 0.693359375f;
  return logw + (e - (w - 1.0f)) / w;
}

// torch's F.softplus (beta 1, threshold 20): x above 20 passes through unchanged.
SCAN_INLINE float softplus_acc(float x) {
  // log(1 + e^x) = max(x, 0) + log1p(e^-|x|), which never overflows.
  const float ax = x < 0.0f ? -x : x;
  const float sp = (x > 0.0f ? x : 0.0f) + log1p_unit_f32(exp_f32(-ax));
  return x > 20.0f ? x : sp;
}
SCAN_INLINE double softplus_acc(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

SCAN_INLINE float exp_acc(float x) { return exp_f32(x); }
SCAN_INLINE double exp_acc(double x) { return std::exp(x); }

template <typename acc_t>
SCAN_INLINE acc_t sigmoid_acc(acc_t x) {
  return acc_t(1) / (acc_t(1) + exp_acc(-x));
}

// ---------------------------------------------------------------------------------------------------------------
// Arguments and per-thread scratch.
// ---------------------------------------------------------------------------------------------------------------

template <typename in_t, typename acc_t>
struct ScanArgs {
  int64_t batch = 0, dim = 0, L = 0, N = 0;
  bool softplus = false;
  const in_t* u = nullptr;      // (batch, dim, L)
  const in_t* delta = nullptr;  // (batch, dim, L)
  const in_t* z = nullptr;      // (batch, dim, L) or null
  const acc_t* A = nullptr;     // (dim, N)
  const acc_t* D = nullptr;     // (dim) or null
  const acc_t* bias = nullptr;  // (dim) or null
  const acc_t* Bt = nullptr;    // (batch, L, N): B transposed, in acc_t
  const acc_t* Ct = nullptr;    // (batch, L, N)
  // forward output
  in_t* out = nullptr;  // (batch, dim, L)
  // backward
  const in_t* dout = nullptr;  // (batch, dim, L)
  in_t* du = nullptr;          // (batch, dim, L)
  in_t* ddelta = nullptr;      // (batch, dim, L)
  in_t* dz = nullptr;          // (batch, dim, L) or null
  // Backward work items: item i = (b = i / chunks, channel block i % chunks of `chunk_dim` channels).
  int64_t chunks = 1, chunk_dim = 0;
  acc_t* dB_part = nullptr;     // (items, L, N): sum over the item's channels
  acc_t* dC_part = nullptr;     // (items, L, N)
  acc_t* dA_part = nullptr;     // (batch, dim, N): sum over time
  acc_t* dD_part = nullptr;     // (batch, dim) or null
  acc_t* dbias_part = nullptr;  // (batch, dim) or null
};

template <typename acc_t>
struct Workspace {
  std::vector<acc_t> u, dt, dsp, y, dy, ddt, du, h, zeros, H, Aexp;
  Workspace(int64_t L, int64_t N, bool backward)
      : u(L), dt(L), y(L), h(N), zeros(N, acc_t(0)) {
    if (backward) {
      dsp.resize(L);
      dy.resize(L);
      ddt.resize(L);
      du.resize(L);
      H.resize(L * N);
      Aexp.resize(L * N);
    }
  }
};

// A row of the input dtype as acc_t: no copy when the types agree.
template <typename in_t, typename acc_t>
SCAN_INLINE const acc_t* row_as_acc(const in_t* src, int64_t L, acc_t* buf) {
  if constexpr (std::is_same<in_t, acc_t>::value) {
    return src;
  } else {
    for (int64_t t = 0; t < L; ++t) buf[t] = static_cast<acc_t>(src[t]);
    return buf;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The math, one (batch, channel) pair at a time.
// ---------------------------------------------------------------------------------------------------------------

// delta' = softplus(delta + bias) (or delta + bias), and, if dsp is given, d delta' / d delta.
template <typename in_t, typename acc_t>
SCAN_INLINE void prepare_delta(const in_t* __restrict delta, acc_t bias, bool softplus, int64_t L,
                               acc_t* __restrict dt, acc_t* __restrict dsp) {
  if (softplus) {
    SCAN_SIMD
    for (int64_t t = 0; t < L; ++t) dt[t] = softplus_acc(static_cast<acc_t>(delta[t]) + bias);
    if (dsp) {
      SCAN_SIMD
      for (int64_t t = 0; t < L; ++t) {
        const acc_t x = static_cast<acc_t>(delta[t]) + bias;
        dsp[t] = x > acc_t(20) ? acc_t(1) : sigmoid_acc(x);
      }
    }
  } else {
    for (int64_t t = 0; t < L; ++t) dt[t] = static_cast<acc_t>(delta[t]) + bias;
    if (dsp) std::fill(dsp, dsp + L, acc_t(1));
  }
}

// The recurrence of one channel:
//   h_t[n] = a_t[n] h_{t-1}[n] + dt_t u_t B_t[n],  a_t[n] = exp(dt_t A[n]);   y[t] = sum_n h_t[n] C_t[n]
// (no D term, no gate). With kStore it also keeps every h_t and a_t (L x N each) for the reverse pass.
template <typename acc_t, bool kStore>
SCAN_INLINE void ssm_forward(int64_t L, int64_t N, const acc_t* __restrict A, const acc_t* __restrict u,
                             const acc_t* __restrict dt, const acc_t* __restrict Bt, const acc_t* __restrict Ct,
                             acc_t* __restrict h, acc_t* __restrict y, acc_t* __restrict H,
                             acc_t* __restrict Aexp) {
  std::fill(h, h + N, acc_t(0));
  for (int64_t t = 0; t < L; ++t) {
    const acc_t d = dt[t];
    const acc_t du = d * u[t];
    const acc_t* __restrict b = Bt + t * N;
    const acc_t* __restrict c = Ct + t * N;
    acc_t s = 0;
    SCAN_SIMD_SUM(s)
    for (int64_t n = 0; n < N; ++n) {
      const acc_t a = exp_acc(d * A[n]);
      const acc_t hn = a * h[n] + du * b[n];
      h[n] = hn;
      s += hn * c[n];
      if (kStore) {
        H[t * N + n] = hn;
        Aexp[t * N + n] = a;
      }
    }
    y[t] = s;
  }
}

// Reverse pass of one channel, given dy = dL/dy (before the D term) and the stored h_t, a_t.
// g_t = dL/dh_t = dy_t C_t + a_{t+1} g_{t+1}; then with x_t[n] = dt_t A[n] and ga = g_t h_{t-1} a_t = dL/dx_t:
//   dA[n] += ga dt_t,  ddt_t = sum_n ga A[n] + u_t sum_n g_t B_t,  du_t += dt_t sum_n g_t B_t,
//   dB_t[n] += g_t dt_t u_t,  dC_t[n] += dy_t h_t[n]   (the last two summed over channels by the caller).
template <typename acc_t>
SCAN_INLINE void ssm_backward(int64_t L, int64_t N, const acc_t* __restrict A, const acc_t* __restrict u,
                              const acc_t* __restrict dt, const acc_t* __restrict Bt,
                              const acc_t* __restrict Ct, const acc_t* __restrict H,
                              const acc_t* __restrict Aexp, const acc_t* __restrict zeros,
                              const acc_t* __restrict dy, acc_t* __restrict g, acc_t* __restrict dB,
                              acc_t* __restrict dC, acc_t* __restrict dA, acc_t* __restrict ddt,
                              acc_t* __restrict du) {
  std::fill(g, g + N, acc_t(0));  // holds a_{t+1} g_{t+1} on entry to step t
  for (int64_t t = L - 1; t >= 0; --t) {
    const acc_t d = dt[t], ut = u[t], dyt = dy[t];
    const acc_t dut = d * ut;
    const acc_t* __restrict b = Bt + t * N;
    const acc_t* __restrict c = Ct + t * N;
    const acc_t* __restrict ht = H + t * N;
    const acc_t* __restrict hprev = t > 0 ? H + (t - 1) * N : zeros;
    const acc_t* __restrict at = Aexp + t * N;
    acc_t* __restrict dBt = dB + t * N;
    acc_t* __restrict dCt = dC + t * N;
    acc_t s_ga = 0, s_gb = 0;
    SCAN_SIMD_SUM(s_ga, s_gb)
    for (int64_t n = 0; n < N; ++n) {
      const acc_t gn = g[n] + dyt * c[n];
      const acc_t ga = gn * hprev[n] * at[n];
      dA[n] += ga * d;
      s_ga += ga * A[n];
      s_gb += gn * b[n];
      dBt[n] += gn * dut;
      dCt[n] += dyt * ht[n];
      g[n] = gn * at[n];
    }
    ddt[t] = s_ga + ut * s_gb;
    du[t] += d * s_gb;
  }
}

template <typename in_t, typename acc_t>
SCAN_INLINE void scan_channel_fwd(const ScanArgs<in_t, acc_t>& p, int64_t b, int64_t d, Workspace<acc_t>& ws) {
  const int64_t L = p.L, N = p.N;
  const int64_t row = (b * p.dim + d) * L;
  const acc_t* u = row_as_acc(p.u + row, L, ws.u.data());
  acc_t* dt = ws.dt.data();
  acc_t* y = ws.y.data();
  prepare_delta(p.delta + row, p.bias ? p.bias[d] : acc_t(0), p.softplus, L, dt, static_cast<acc_t*>(nullptr));
  ssm_forward<acc_t, false>(L, N, p.A + d * N, u, dt, p.Bt + b * L * N, p.Ct + b * L * N, ws.h.data(), y,
                            nullptr, nullptr);
  const acc_t Dd = p.D ? p.D[d] : acc_t(0);
  in_t* __restrict out = p.out + row;
  if (p.z) {
    const in_t* __restrict z = p.z + row;
    SCAN_SIMD
    for (int64_t t = 0; t < L; ++t) {
      const acc_t zt = static_cast<acc_t>(z[t]);
      out[t] = static_cast<in_t>((y[t] + Dd * u[t]) * zt * sigmoid_acc(zt));
    }
  } else {
    for (int64_t t = 0; t < L; ++t) out[t] = static_cast<in_t>(y[t] + Dd * u[t]);
  }
}

// dB / dC of this channel are added into the work item's (L, N) buffers dB, dC; dA / dD / ddelta_bias go into
// this (b, d)'s own slots of the partial buffers.
template <typename in_t, typename acc_t>
SCAN_INLINE void scan_channel_bwd(const ScanArgs<in_t, acc_t>& p, int64_t b, int64_t d, Workspace<acc_t>& ws,
                                  acc_t* dB, acc_t* dC) {
  const int64_t L = p.L, N = p.N;
  const int64_t row = (b * p.dim + d) * L;
  const acc_t* __restrict u = row_as_acc(p.u + row, L, ws.u.data());
  acc_t* __restrict dt = ws.dt.data();
  acc_t* __restrict dsp = ws.dsp.data();
  acc_t* __restrict y = ws.y.data();
  acc_t* __restrict dy = ws.dy.data();
  acc_t* __restrict du = ws.du.data();
  acc_t* __restrict ddt = ws.ddt.data();
  const acc_t* A = p.A + d * N;
  const acc_t* Bt = p.Bt + b * L * N;
  const acc_t* Ct = p.Ct + b * L * N;

  // 1. Recompute the forward of this channel, keeping the states.
  prepare_delta(p.delta + row, p.bias ? p.bias[d] : acc_t(0), p.softplus, L, dt, dsp);
  ssm_forward<acc_t, true>(L, N, A, u, dt, Bt, Ct, ws.h.data(), y, ws.H.data(), ws.Aexp.data());

  // 2. Through the gate and the skip term: out = (y + D u) silu(z).
  const acc_t Dd = p.D ? p.D[d] : acc_t(0);
  const in_t* __restrict dout = p.dout + row;
  if (p.z) {
    const in_t* __restrict z = p.z + row;
    in_t* __restrict dz = p.dz + row;
    SCAN_SIMD
    for (int64_t t = 0; t < L; ++t) {
      const acc_t zt = static_cast<acc_t>(z[t]), go = static_cast<acc_t>(dout[t]);
      const acc_t sg = sigmoid_acc(zt);
      const acc_t yt = y[t] + Dd * u[t];
      dz[t] = static_cast<in_t>(go * yt * sg * (acc_t(1) + zt * (acc_t(1) - sg)));  // silu' = s (1 + z (1 - s))
      dy[t] = go * zt * sg;
    }
  } else {
    for (int64_t t = 0; t < L; ++t) dy[t] = static_cast<acc_t>(dout[t]);
  }
  acc_t dD = 0;
  SCAN_SIMD_SUM(dD)
  for (int64_t t = 0; t < L; ++t) {
    dD += dy[t] * u[t];
    du[t] = dy[t] * Dd;
  }

  // 3. The reverse recurrence.
  ssm_backward(L, N, A, u, dt, Bt, Ct, ws.H.data(), ws.Aexp.data(), ws.zeros.data(), dy, ws.h.data(), dB, dC,
               p.dA_part + (b * p.dim + d) * N, ddt, du);

  // 4. Back through softplus(delta + bias).
  in_t* __restrict ddelta = p.ddelta + row;
  in_t* __restrict du_out = p.du + row;
  acc_t dbias = 0;
  SCAN_SIMD_SUM(dbias)
  for (int64_t t = 0; t < L; ++t) {
    const acc_t g = ddt[t] * dsp[t];
    dbias += g;
    ddelta[t] = static_cast<in_t>(g);
    du_out[t] = static_cast<in_t>(du[t]);
  }
  if (p.dD_part) p.dD_part[b * p.dim + d] = dD;
  if (p.dbias_part) p.dbias_part[b * p.dim + d] = dbias;
}

// ---------------------------------------------------------------------------------------------------------------
// Ranges of work, compiled per instruction set. The *_impl bodies are force-inlined into each variant so that
// all of the math above is generated with that variant's vector instructions.
// ---------------------------------------------------------------------------------------------------------------

template <typename in_t, typename acc_t>
SCAN_INLINE void fwd_range_impl(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  Workspace<acc_t> ws(p.L, p.N, /*backward=*/false);
  for (int64_t i = begin; i < end; ++i) scan_channel_fwd(p, i / p.dim, i % p.dim, ws);
}

template <typename in_t, typename acc_t>
SCAN_INLINE void bwd_range_impl(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  Workspace<acc_t> ws(p.L, p.N, /*backward=*/true);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.chunks;
    const int64_t d0 = (item % p.chunks) * p.chunk_dim;
    const int64_t d1 = std::min(p.dim, d0 + p.chunk_dim);
    acc_t* dB = p.dB_part + item * p.L * p.N;  // zero-initialised by the caller
    acc_t* dC = p.dC_part + item * p.L * p.N;
    for (int64_t d = d0; d < d1; ++d) scan_channel_bwd(p, b, d, ws, dB, dC);
  }
}

template <typename in_t, typename acc_t>
void fwd_range_generic(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  fwd_range_impl(p, begin, end);
}
template <typename in_t, typename acc_t>
void bwd_range_generic(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  bwd_range_impl(p, begin, end);
}

#if SCAN_X86_DISPATCH
template <typename in_t, typename acc_t>
SCAN_TARGET_AVX2 void fwd_range_avx2(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  fwd_range_impl(p, begin, end);
}
template <typename in_t, typename acc_t>
SCAN_TARGET_AVX2 void bwd_range_avx2(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  bwd_range_impl(p, begin, end);
}

bool cpu_has_avx2_fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}
#endif

template <typename in_t, typename acc_t>
void fwd_range(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
#if SCAN_X86_DISPATCH
  if (cpu_has_avx2_fma()) return fwd_range_avx2(p, begin, end);
#endif
  fwd_range_generic(p, begin, end);
}

template <typename in_t, typename acc_t>
void bwd_range(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
#if SCAN_X86_DISPATCH
  if (cpu_has_avx2_fma()) return bwd_range_avx2(p, begin, end);
#endif
  bwd_range_generic(p, begin, end);
}

// ---------------------------------------------------------------------------------------------------------------
// Drivers.
// ---------------------------------------------------------------------------------------------------------------

// Roughly how many (b, d, t, n) steps one parallel chunk should hold, so tiny problems do not pay for threads.
constexpr int64_t kMinStepsPerChunk = 1 << 15;
// The backward cuts each batch row into enough channel blocks to have about this many work items overall.
// It depends on the shape only, so the summation order (and the result) does not depend on the thread count.
constexpr int64_t kTargetBackwardItems = 32;

template <typename acc_t>
const acc_t* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<acc_t>() : nullptr;
}

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// B or C (batch, N, L) -> (batch, L, N) in the accumulation type.
at::Tensor to_time_major(const at::Tensor& x, at::ScalarType acc) {
  return x.to(acc).transpose(1, 2).contiguous();
}

template <typename in_t, typename acc_t>
ScanArgs<in_t, acc_t> common_args(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                  const at::Tensor& Bt, const at::Tensor& Ct, const std::optional<at::Tensor>& D,
                                  const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& delta_bias,
                                  bool softplus) {
  ScanArgs<in_t, acc_t> p;
  p.batch = u.size(0);
  p.dim = u.size(1);
  p.L = u.size(2);
  p.N = A.size(1);
  p.softplus = softplus;
  p.u = u.data_ptr<in_t>();
  p.delta = delta.data_ptr<in_t>();
  p.z = has(z) ? z->data_ptr<in_t>() : nullptr;
  p.A = A.data_ptr<acc_t>();
  p.D = opt_ptr<acc_t>(D);
  p.bias = opt_ptr<acc_t>(delta_bias);
  p.Bt = Bt.data_ptr<acc_t>();
  p.Ct = Ct.data_ptr<acc_t>();
  return p;
}

template <typename in_t, typename acc_t>
void run_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& Bt,
             const at::Tensor& Ct, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
             const std::optional<at::Tensor>& delta_bias, bool softplus, at::Tensor& out) {
  auto p = common_args<in_t, acc_t>(u, delta, A, Bt, Ct, D, z, delta_bias, softplus);
  p.out = out.data_ptr<in_t>();
  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / std::max<int64_t>(1, p.L * p.N));
  at::parallel_for(0, p.batch * p.dim, grain, [&](int64_t begin, int64_t end) { fwd_range(p, begin, end); });
}

template <typename in_t, typename acc_t>
void run_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& Bt,
             const at::Tensor& Ct, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
             const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout, bool softplus, at::Tensor& du,
             at::Tensor& ddelta, at::Tensor& dA, at::Tensor& dB, at::Tensor& dC, at::Tensor& dD, at::Tensor& dz,
             at::Tensor& dbias) {
  auto p = common_args<in_t, acc_t>(u, delta, A, Bt, Ct, D, z, delta_bias, softplus);
  const int64_t batch = p.batch, dim = p.dim, L = p.L, N = p.N;
  p.dout = dout.data_ptr<in_t>();
  p.du = du.data_ptr<in_t>();
  p.ddelta = ddelta.data_ptr<in_t>();
  p.dz = dz.defined() ? dz.data_ptr<in_t>() : nullptr;

  // Work items and their partial sums (see the comment at the top of the file).
  int64_t chunks = std::min(dim, std::max<int64_t>(1, (kTargetBackwardItems + batch - 1) / batch));
  p.chunk_dim = (dim + chunks - 1) / chunks;
  p.chunks = chunks = (dim + p.chunk_dim - 1) / p.chunk_dim;
  const int64_t items = batch * chunks;
  const auto acc_opts = A.options();
  at::Tensor dB_part = at::zeros({items, L, N}, acc_opts);
  at::Tensor dC_part = at::zeros({items, L, N}, acc_opts);
  at::Tensor dA_part = at::zeros({batch, dim, N}, acc_opts);
  at::Tensor dD_part = dD.defined() ? at::zeros({batch, dim}, acc_opts) : at::Tensor();
  at::Tensor dbias_part = dbias.defined() ? at::zeros({batch, dim}, acc_opts) : at::Tensor();
  p.dB_part = dB_part.data_ptr<acc_t>();
  p.dC_part = dC_part.data_ptr<acc_t>();
  p.dA_part = dA_part.data_ptr<acc_t>();
  p.dD_part = dD_part.defined() ? dD_part.data_ptr<acc_t>() : nullptr;
  p.dbias_part = dbias_part.defined() ? dbias_part.data_ptr<acc_t>() : nullptr;

  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / std::max<int64_t>(1, p.chunk_dim * L * N));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) { bwd_range(p, begin, end); });

  // Fixed-order reductions of the partials.
  //   dB[b, n, t] = sum_k dB_part[b * chunks + k, t, n]   (and dC alike), written in the input dtype.
  in_t* dB_out = dB.data_ptr<in_t>();
  in_t* dC_out = dC.data_ptr<in_t>();
  const acc_t* dBp = p.dB_part;
  const acc_t* dCp = p.dC_part;
  at::parallel_for(0, batch * N, std::max<int64_t>(1, kMinStepsPerChunk / std::max<int64_t>(1, chunks * L)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t bn = begin; bn < end; ++bn) {
                       const int64_t b = bn / N, n = bn % N;
                       for (int64_t t = 0; t < L; ++t) {
                         acc_t sb = 0, sc = 0;
                         for (int64_t k = 0; k < chunks; ++k) {
                           const int64_t at_ = ((b * chunks + k) * L + t) * N + n;
                           sb += dBp[at_];
                           sc += dCp[at_];
                         }
                         dB_out[bn * L + t] = static_cast<in_t>(sb);
                         dC_out[bn * L + t] = static_cast<in_t>(sc);
                       }
                     }
                   });
  //   dA, dD, ddelta_bias: sum over the batch.
  auto sum_over_batch = [batch](const acc_t* part, int64_t inner, acc_t* result) {
    for (int64_t i = 0; i < inner; ++i) {
      acc_t s = 0;
      for (int64_t b = 0; b < batch; ++b) s += part[b * inner + i];
      result[i] = s;
    }
  };
  sum_over_batch(p.dA_part, dim * N, dA.data_ptr<acc_t>());
  if (dD.defined()) sum_over_batch(p.dD_part, dim, dD.data_ptr<acc_t>());
  if (dbias.defined()) sum_over_batch(p.dbias_part, dim, dbias.data_ptr<acc_t>());
}

at::ScalarType acc_type_of(at::ScalarType in) {
  return in == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

std::vector<at::Tensor> selective_scan_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, bool delta_softplus) {
  const auto acc = acc_type_of(u.scalar_type());
  const at::Tensor Bt = to_time_major(B, acc), Ct = to_time_major(C, acc);
  at::Tensor out = at::empty_like(u);
  switch (u.scalar_type()) {
    case at::kFloat:
      run_fwd<float, float>(u, delta, A, Bt, Ct, D, z, delta_bias, delta_softplus, out);
      break;
    case at::kDouble:
      run_fwd<double, double>(u, delta, A, Bt, Ct, D, z, delta_bias, delta_softplus, out);
      break;
    case at::kBFloat16:
      run_fwd<c10::BFloat16, float>(u, delta, A, Bt, Ct, D, z, delta_bias, delta_softplus, out);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", u.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  return {out, at::empty({0}, u.options())};
}

std::vector<at::Tensor> selective_scan_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout,
                                           bool delta_softplus) {
  const auto acc = acc_type_of(u.scalar_type());
  const at::Tensor Bt = to_time_major(B, acc), Ct = to_time_major(C, acc);
  at::Tensor du = at::empty_like(u);
  at::Tensor ddelta = at::empty_like(delta);
  at::Tensor dA = at::empty_like(A);
  at::Tensor dB = at::empty_like(B);
  at::Tensor dC = at::empty_like(C);
  at::Tensor dD = has(D) ? at::empty_like(*D) : at::Tensor();
  at::Tensor dz = has(z) ? at::empty_like(*z) : at::Tensor();
  at::Tensor dbias = has(delta_bias) ? at::empty_like(*delta_bias) : at::Tensor();
  switch (u.scalar_type()) {
    case at::kFloat:
      run_bwd<float, float>(u, delta, A, Bt, Ct, D, z, delta_bias, dout, delta_softplus, du, ddelta, dA, dB, dC,
                            dD, dz, dbias);
      break;
    case at::kDouble:
      run_bwd<double, double>(u, delta, A, Bt, Ct, D, z, delta_bias, dout, delta_softplus, du, ddelta, dA, dB,
                              dC, dD, dz, dbias);
      break;
    case at::kBFloat16:
      run_bwd<c10::BFloat16, float>(u, delta, A, Bt, Ct, D, z, delta_bias, dout, delta_softplus, du, ddelta, dA,
                                    dB, dC, dD, dz, dbias);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", u.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  return {du, ddelta, dA, dB, dC, dD, dz, dbias};
}

}  // namespace scan_cpu
}  // namespace vim_ds
